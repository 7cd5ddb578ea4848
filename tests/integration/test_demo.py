"""``python -m celery_ext.demo`` end to end, from an empty folder: its own embedded
server, two pools, the dashboard and Flower; the URLs and commands it prints work while
it runs; the killed pool's jobs are reported recovered; the periodic job runs; Ctrl-C
leaves no process behind, and ``--seconds`` stops it by itself with a verdict."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from celery_ext.demo.show import job_label
from tests.helpers import wait_for
from tests.workers import REPO_ROOT

#: Shorter reaper timings than the demo's own (it keeps values already set).
FAST = {"CELERY_EXT_HEARTBEAT_INTERVAL": "0.5", "CELERY_EXT_DEAD_AFTER": "2",
        "CELERY_EXT_REAP_INTERVAL": "0.5"}


class Demo:
    """The demo as a subprocess in its own session (a SIGINT sent to it is Ctrl-C),
    its output collected line by line."""

    def __init__(self, folder: Path, *args: str, **env_vars: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_EXT_")}
        env.update(FAST, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", **env_vars)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery_ext.demo", *args], cwd=folder, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def line(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first output line matching ``pattern`` (waits for it)."""

        def find() -> re.Match[str] | None:
            done = not self._reader.is_alive()  # read before the lines: none come after
            for line in list(self.lines):
                match = re.search(pattern, line)
                if match:
                    return match
            if done:
                raise AssertionError(f"the demo exited ({self.proc.poll()})")
            return None

        try:
            return wait_for(find, timeout, f"a line matching {pattern!r}", step=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; output so far:\n{self.output}") from None


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _ps_groups() -> dict[int, list[int]]:
    """Process group -> pids, as ``ps`` lists them (zombies, which are not running,
    left out)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,pgid=,stat="], capture_output=True,
                         text=True, check=True).stdout
    groups: dict[int, list[int]] = {}
    for row in out.splitlines():
        pid, pgid, stat = row.split(None, 2)
        if not stat.startswith("Z"):
            groups.setdefault(int(pgid), []).append(int(pid))
    return groups


def _stop(d: Demo) -> None:
    """Stop a demo the test left running (it failed before its Ctrl-C)."""
    if d.proc.poll() is None:
        d.proc.send_signal(signal.SIGINT)
        try:
            d.proc.wait(60)
        except subprocess.TimeoutExpired:
            for p in _tree(d.proc.pid)[::-1]:
                p.kill()


@pytest.fixture
def empty(tmp_path: Path) -> Path:
    """An empty folder to run the demo in: nothing of the checkout's beside it (the
    checkout is on PYTHONPATH only as an installed package would be on sys.path)."""
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


@pytest.fixture
def demo(empty: Path) -> Iterator[Demo]:
    d = Demo(empty, "--kill-after", "5", "--web-port", "0", "--flower-port", "0",
             "--status-every", "2", "--concurrency", "3")
    yield d
    _stop(d)


def test_demo_shows_everything_and_stops_cleanly(demo: Demo, empty: Path) -> None:
    dashboard = demo.line(r"^\s+dashboard\s+(http://\S+)$", 120).group(1)
    flower = demo.line(r"^\s+flower\s+(http://\S+)$", 5).group(1)
    status_cmd = demo.line(r"^\s+(CELERY_EXT_BROKER_URL=\S+ .* ext status)$", 5).group(1)
    assert "celery-ext://127.0.0.1:" in status_cmd  # the embedded server's URL filled in

    # While it runs, what it prints works: the dashboard, Flower, the suggested command.
    with urllib.request.urlopen(dashboard + "api/health", timeout=10) as reply:
        assert json.loads(reply.read())["ok"] is True
    with urllib.request.urlopen(flower, timeout=10) as reply:
        assert reply.status == 200
    status = subprocess.run(["bash", "-c", status_cmd], cwd=empty, capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "demo-a@" in status.stdout and "demo-b@" in status.stdout

    # The kill, and the recovery as read from Redis and the result backend.
    # Each job is named <job name>[<id>]; an id need not be a UUID (the unique jobs'
    # are refresh-<n>-<attempt>), so the names are matched as the kill line lists them.
    killed = demo.line(r"SIGKILLed pool demo-b \(process group \d+\): it owned (\d+) "
                       r"job\(s\) in flight: (.+)$", 60)
    owned = int(killed.group(1))
    assert owned >= 1  # it waits for demo-b to run a long job
    jobs = killed.group(2).split(", ")
    assert len(set(jobs)) == len(jobs) == owned, jobs  # each job named apart from the others
    demo.line(rf"reaper: pool demo-b declared dead [\d.]+s after the kill; .* its {owned} "
              r"job\(s\) are back", 30)
    demo.line(rf"recovery complete: all {owned} job\(s\) pool demo-b owned when it was "
              r"killed ran again on demo-a; none lost", 60)
    # Every job it owned reported run, once each, before the recovery is complete (with
    # its new result, or, when its first run had stored one before the kill, from the
    # job index: "ran on demo-a (its first run had finished before the kill ...").
    ran = re.findall(r"recovered job (\S+) ran on demo-a(?:: | \(its first run)", demo.output)
    assert sorted(ran) == sorted(jobs), demo.output
    # The long job it ran went on from its cursor (resumable jobs), not from step 1.
    assert re.search(r"recovered job build_report\[\S+\] ran on demo-a: SUCCESS, resumed "
                     r"after step \d+ \(its cursor\)", demo.output), demo.output
    demo.line(r"started a new pool demo-b \(pid \d+\)", 5)
    # The app's periodic job (every 10 s), enqueued by the pools and run.
    demo.line(r"periodic runs [1-9]", 30)
    assert re.search(r"\d+ unique duplicates dropped", demo.output)

    # Ctrl-C: every process it started (server, pools and their children, dashboard,
    # Flower), each in its own process group, is gone.
    # The demo, the server, two pools of a main process and 3 children, dashboard, Flower
    # (the new demo-b forks its children as it starts).
    tree = wait_for(lambda: (lambda t: t if len(t) >= 1 + 1 + 2 * 4 + 2 else None)(
        _tree(demo.proc.pid)), 60, "the new pool demo-b's children")
    groups = {p.pid for p in tree[1:] if os.getpgid(p.pid) == p.pid}
    assert len(groups) == 5  # server, two pools, dashboard, Flower: one group each
    demo.proc.send_signal(signal.SIGINT)
    assert demo.proc.wait(60) == 0, demo.output
    demo.line(r"^stopped: nothing left running$", 5)
    assert not set(_ps_groups()) & groups, demo.output
    assert not [p.pid for p in tree[1:] if p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]


def test_job_label_tells_apart_jobs_whose_ids_are_not_uuids() -> None:
    """A UUID is cut to 8 hex digits; the unique jobs' ids (refresh-<n>-<attempt>) are
    kept whole, since cut to 8 characters every one of them reads "refresh-"."""
    job_id = "72918137-0de8-46d1-942e-76d1edd47ee4"
    assert job_label("tasks.jobs.build_report", job_id) == "build_report[72918137]"
    labels = {job_label("tasks.jobs.refresh_cache", f"refresh-{n}-{attempt}")
              for n in (1, 15) for attempt in (0, 1)}
    assert labels == {"refresh_cache[refresh-1-0]", "refresh_cache[refresh-1-1]",
                      "refresh_cache[refresh-15-0]", "refresh_cache[refresh-15-1]"}


def test_demo_app_has_a_periodic_job() -> None:
    """The dashboard's Periodic page has an entry to show: the app's beat_schedule names
    one of its own jobs, due every few seconds."""
    from celery.beat import ScheduleEntry

    from celery_ext.demo.app import app, purge_sessions

    entries = {name: ScheduleEntry(name=name, app=app, **spec)
               for name, spec in app.conf.beat_schedule.items()}
    assert [e.task for e in entries.values()] == [purge_sessions.name]
    [entry] = entries.values()
    assert entry.task in app.tasks
    assert 0 < entry.schedule.run_every.total_seconds() <= 10


def test_demo_with_seconds_stops_by_itself(empty: Path) -> None:
    """``--seconds``: it stops after that long of jobs and exits 0 once jobs finished
    and the periodic job ran (what CI asks of the demo installed from the wheel)."""
    d = Demo(empty, "--seconds", "12", "--kill-after", "600", "--web-port", "0",
             "--flower-port", "0", "--status-every", "3", "--concurrency", "2")
    try:
        assert d.proc.wait(180) == 0, d.output
        d.line(r"ok after \d+s of jobs: [1-9]\d* job\(s\) finished, [1-9]\d* periodic run",
               5)
        d.line(r"^stopped: nothing left running$", 5)
        assert not list(empty.iterdir())  # nothing written where it ran
    finally:
        _stop(d)


def test_demo_with_seconds_fails_without_a_periodic_run(empty: Path) -> None:
    """The verdict can fail: with the pools' periodic jobs turned off, no periodic run
    happens and the demo exits 1, saying so (after a ``--verdict-wait`` shorter than its
    default, which a run that cannot pass would wait out)."""
    d = Demo(empty, "--seconds", "3", "--verdict-wait", "1", "--kill-after", "600",
             "--web-port", "0", "--flower-port", "0", "--concurrency", "1",
             CELERY_EXT_PERIODIC="0")
    try:
        assert d.proc.wait(180) == 1, d.output
        d.line(r"FAILED after \d+s of jobs: \d+ job\(s\) finished, 0 periodic run", 5)
    finally:
        _stop(d)
