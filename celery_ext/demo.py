"""``./dev demo``: everything celery_ext does, running, until Ctrl-C.

It starts (each in its own process group, so a Ctrl-C reaches only this process,
which then stops them in order):

- an embedded Valkey/Redis server, unless ``CELERY_EXT_BROKER_URL`` names one;
- two worker pools, ``celery -A tasks worker`` subprocesses (``demo-a``, ``demo-b``);
- the dashboard (``celery -A tasks ext web``) and Flower (``celery -A tasks flower``,
  whose broker page reads our job queues through :mod:`celery_ext.flower`).

It prints their URLs and the commands to try (with the broker URL filled in), then
enqueues the example jobs of ``tasks/`` at a steady rate: short, long (checking in),
flaky (retrying, some into the dead set), scheduled (countdown), unique and
rate-limited. After ``--kill-after`` seconds it SIGKILLs pool ``demo-b`` and shows,
read from Redis, the jobs that pool owned being requeued by the reaper in
``demo-a`` and run there. Ctrl-C stops everything: producer, dashboard and Flower,
the pools (warm shutdown: a long job learns it at its next checkin), the server.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kombu.utils.encoding import bytes_to_str

from celery_ext.admin.overview import State
from celery_ext.config import Settings
from celery_ext.store.clock import now_ms
from celery_ext.store.connections import client_from_url
from celery_ext.testing.server import RedisServer

ROOT = Path(__file__).resolve().parent.parent
#: The example app every process of the demo loads.
APP = "tasks"
#: Worker pool node names; the second is the one killed.
NODES = ("demo-a", "demo-b")
#: Short reaper timings, so a killed pool's jobs come back within seconds (each a
#: ``CELERY_EXT_<NAME>`` variable; values already in the environment win).
DEMO_TIMINGS = {"HEARTBEAT_INTERVAL": "1", "DEAD_AFTER": "4", "REAP_INTERVAL": "1"}
#: Seconds a stopping child gets before its process group is SIGKILLed (a warm
#: shutdown waits for running jobs; the long ones stop at their next checkin).
STOP_TIMEOUT = 20.0
#: Seconds the processes get to start (two Celery workers, Flower and the dashboard
#: start at once on what may be a small machine).
START_TIMEOUT = 90.0
#: Most seconds the kill waits for ``demo-b`` to run a long job with half of it still to
#: go (there is nothing to show recovering otherwise).
KILL_WAIT = 15.0
#: Signals that stop the demo (its children, in their own sessions, get none of them).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# -- child processes ---------------------------------------------------------------------
class Child:
    """A subprocess in its own process group, its output in a log file."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log_dir: Path
                 ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                list(argv), cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _signal_group(self, sig: int) -> None:
        # The group id is the leader's pid (start_new_session); the group may outlive
        # its leader (a prefork child), so it is signalled even after the leader exits.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL the whole group (the pool's main process and its children), as a
        lost host would."""
        self._signal_group(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal_group(signal.SIGTERM)

    def wait_stopped(self, deadline: float) -> bool:
        """Wait for the leader until ``deadline`` (monotonic), then SIGKILL what is left
        of the group; True if it stopped by itself."""
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
            clean = True
        except subprocess.TimeoutExpired:
            clean = False
        self._signal_group(signal.SIGKILL)
        self.proc.wait()
        return clean


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _pick_port(wanted: int) -> int:
    """``wanted`` if it is free, else (or for 0) any free port."""
    if wanted and _port_free(wanted):
        return wanted
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _wait(what: str, cond: Callable[[], bool], children: Sequence[Child], timeout: float
          ) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for child in children:
            if not child.running:
                raise RuntimeError(f"{child.name} exited with code {child.proc.returncode} "
                                   f"while waiting for {what}:\n{child.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


# -- what the demo prints ----------------------------------------------------------------
class Out:
    """Timestamped event lines; on a terminal a redrawn screen with the last of them."""

    def __init__(self, header: list[str], tty: bool) -> None:
        self.header = header
        self.tty = tty
        self.started = time.monotonic()
        self.events: list[str] = []

    def event(self, text: str) -> None:
        line = f"[{time.monotonic() - self.started:6.1f}s] {text}"
        self.events.append(line)
        if not self.tty:
            print(line, flush=True)

    def screen(self, body: list[str]) -> None:
        if self.tty:
            lines = [*self.header, "", *body, "", *self.events[-12:]]
            print("\033[H\033[J" + "\n".join(lines), flush=True)


def _status_lines(state: State) -> list[str]:
    """Queues, pools and busy workers, read from Redis as the dashboard does."""
    lines = [f"{'job queue':28} {'queued':>6} {'in flight':>9} {'done':>6} {'failed':>6}"]
    for q in state.job_queues():
        if q["name"].startswith("tasks."):
            lines.append(f"{q['name']:28} {q['size']:>6} {q['in_flight']:>9} "
                         f"{q['processed']:>6} {q['failed']:>6}")
    lines.append("")
    for p in state.worker_pools():
        lines.append(f"pool {p['node']:24} {p['state']:8} in flight {p['in_flight']}")
    busy = state.busy_workers()
    lines.append(f"busy workers: {len(busy)}")
    for b in busy[:8]:
        progress = f"{b['progress'] * 100:5.1f}%" if b["progress"] is not None else "   -  "
        lines.append(f"  {b['job_name']:28} {progress} {b['checkin_message'] or ''}")
    return lines


def _runs_long_job(state: State, pool_id: str, task: Any) -> bool:
    """Does the pool run a job of ``task`` (a long one, there to show running on) with
    half of it or more still to go? One near its end can finish and be acked between
    this read and the kill, which then finds the pool owning nothing to recover."""
    return any(b["pool_id"] == pool_id and b["job_name"] == task.name
               and (b["progress"] is None or b["progress"] < 0.5)
               for b in state.busy_workers())


def job_label(name: str, job_id: str) -> str:
    """A job as the demo's output names it: ``<last part of the job name>[<id>]``.

    A Celery UUID is cut to its first 8 hex digits (enough to tell apart the few jobs a
    pool owns); any other id, such as the unique jobs' ``refresh-<n>-<attempt>``, is
    shown whole, since its first characters are shared by every job of its kind."""
    try:
        short = str(uuid.UUID(job_id))[:8]
    except ValueError:
        short = job_id
    return f"{name.split('.')[-1]}[{short}]"


def _summary(state: State) -> str:
    k = state.keys
    with state.client.pipeline(transaction=False) as pipe:
        pipe.zcard(k.scheduled)
        pipe.zcard(k.retry)
        pipe.zcard(k.dead)
        scheduled, retry, dead = pipe.execute()
    queues = [q for q in state.job_queues() if q["name"].startswith("tasks.")]
    pools = state.worker_pools()
    return (f"queued {sum(q['size'] for q in queues)}  "
            f"in flight {sum(q['in_flight'] for q in queues)}  "
            f"done {sum(q['processed'] for q in queues)}  scheduled {scheduled}  "
            f"retry {retry}  dead {dead}  pools "
            + ", ".join(f"{p['node'].split('@')[0]}:{p['state']}" for p in pools))


# -- the producer ------------------------------------------------------------------------
@dataclass
class Producer:
    """Enqueues the example jobs at a steady rate, in a fixed mix."""

    rate: float
    sent: dict[str, int] = field(default_factory=dict)
    deduplicated: int = 0
    _next: float = 0.0
    _n: Iterator[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        import tasks

        self.tasks = tasks
        # Per 14 jobs: 8 short, 2 long, one flaky, scheduled, unique and rate-limited.
        self.mix: list[tuple[str, Callable[[int], Any]]] = [
            *[("short", self._short)] * 8, *[("long", self._long)] * 2,
            ("flaky", self._flaky), ("scheduled", self._scheduled),
            ("unique", self._unique), ("rate-limited", self._rate_limited),
        ]
        self._kinds = itertools.cycle(random.sample(self.mix, len(self.mix)))

    def _short(self, i: int) -> Any:
        return self.tasks.send_notice.delay(i)

    def _long(self, i: int) -> Any:
        return self.tasks.build_report.delay(i, steps=12, step_seconds=0.4)

    def _flaky(self, i: int) -> Any:
        return self.tasks.sync_account.delay(i, fail_rate=0.6)

    def _scheduled(self, i: int) -> Any:
        return self.tasks.send_notice.apply_async((i,), countdown=random.uniform(3, 12))

    def _unique(self, i: int) -> Any:
        # Twice the same refresh, due in a few seconds: the second is a duplicate of a
        # pending job (dropped: the caller gets the pending job's id), and so is the
        # first when the same key's job from an earlier round is still pending.
        for attempt in range(2):
            job_id = f"refresh-{i}-{attempt}"
            result = self.tasks.refresh_cache.apply_async((f"key{i % 3}",), task_id=job_id,
                                                          countdown=4)
            if result.id != job_id:
                self.deduplicated += 1
        return result

    def _rate_limited(self, i: int) -> Any:
        return self.tasks.call_partner_api.delay(i)

    def tick(self, now: float) -> None:
        """Send the jobs due by ``now`` (monotonic)."""
        if not self._next:
            self._next = now
        while self._next <= now:
            kind, send = next(self._kinds)
            send(next(self._n))
            self.sent[kind] = self.sent.get(kind, 0) + 1
            self._next += 1.0 / self.rate


# -- the kill and the recovery -----------------------------------------------------------
@dataclass
class Recovery:
    """Follows the jobs a killed pool owned, as Redis and the result backend record
    them: requeued by the reaper (the pool leaves ``{ns}:pools``, its in-flight record
    empties, each job gets a recovery count in ``{ns}:redelivery``), then run by the
    surviving pool (the result's ``worker``, stored with ``result_extended``)."""

    state: State
    pool_id: str
    node: str
    killed_at_ms: int
    #: delivery tag -> (job id, job name), from the killed pool's in-flight record.
    jobs: dict[str, tuple[str, str]]
    reaped_after: float | None = None
    recoveries: dict[str, int] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)
    #: job id -> when its result was stored before the kill (a finished run that was
    #: not yet acked, or an earlier attempt of a retried job): not this recovery's run.
    before: dict[str, Any] = field(default_factory=dict)
    done: bool = False

    @classmethod
    def snapshot(cls, state: State, pool_id: str, node: str) -> Recovery:
        """Read the killed pool's in-flight record (it stays in Redis until reaped)."""
        jobs: dict[str, tuple[str, str]] = {}
        for tag, record in state.client.hgetall(state.keys.inflight(pool_id)).items():
            _queue, payload = bytes_to_str(record).split("\n", 1)
            headers = json.loads(payload).get("headers") or {}
            jobs[bytes_to_str(tag)] = (str(headers.get("id")), str(headers.get("task")))
        return cls(state, pool_id, node, now_ms(state.client), jobs)

    def note_results(self, app: Any) -> None:
        self.before = {job_id: app.AsyncResult(job_id).date_done
                       for job_id, _name in self.jobs.values()}

    def poll(self, app: Any, out: Out) -> None:
        client, k = self.state.client, self.state.keys
        tags = list(self.jobs)
        if self.reaped_after is None:
            with client.pipeline(transaction=False) as pipe:
                pipe.zscore(k.pools, self.pool_id)
                pipe.exists(k.inflight(self.pool_id))
                pipe.hmget(k.redelivery, tags or ["-"])
                beat, owns, counts = pipe.execute()
            if beat is not None or owns:
                return
            self.reaped_after = (now_ms(client) - self.killed_at_ms) / 1000
            self.recoveries = {t: int(c) for t, c in zip(tags, counts, strict=False) if c}
            out.event(
                f"reaper: pool {self.node} declared dead "
                f"{self.reaped_after:.1f}s after the kill; its in-flight record is empty and "
                f"its {len(self.jobs)} job(s) are back at the front of their queues "
                f"({len(self.recoveries)} with recovery count 1 in Redis now, the others "
                f"already fetched and finished again)")
        for tag, (job_id, name) in self.jobs.items():
            if tag in self.finished:
                continue
            result = app.AsyncResult(job_id)
            if result.state in ("SUCCESS", "FAILURE", "RETRY", "REVOKED") \
                    and result.date_done != self.before.get(job_id):
                worker = str(result.worker or "?").split("@")[0]
                self.finished[tag] = worker
                out.event(f"recovered job {job_label(name, job_id)} ran on {worker}: "
                          f"{result.state}")
        if len(self.finished) == len(self.jobs) and self.reaped_after is not None:
            self.done = True
            by = sorted(set(self.finished.values()))
            out.event(f"recovery complete: all {len(self.jobs)} job(s) pool "
                      f"{self.node} owned when it was killed "
                      f"ran again on {', '.join(by) or '-'}; none lost")


# -- the demo ----------------------------------------------------------------------------
def _celery_cmd() -> list[str]:
    """How to run ``celery`` as printed for the user: the venv's, relative to the repo
    root when the venv is inside it."""
    exe = Path(sys.executable)
    try:
        shown = str(exe.relative_to(ROOT))
    except ValueError:
        shown = str(exe)
    return [shown, "-m", "celery", "-A", APP]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev demo", description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=4.0, help="jobs enqueued per second")
    parser.add_argument("--kill-after", type=float, default=20.0,
                        help="seconds of producing before pool demo-b is SIGKILLed")
    parser.add_argument("--concurrency", type=int, default=4, help="slots per worker pool")
    parser.add_argument("--web-port", type=int, default=5040, help="0: any free port")
    parser.add_argument("--flower-port", type=int, default=5555, help="0: any free port")
    parser.add_argument("--status-every", type=float, default=3.0,
                        help="seconds between status lines when not on a terminal")
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.concurrency < 1:
        parser.error("--rate must be positive and --concurrency at least 1")

    # Ctrl-C, SIGTERM and a closed terminal all stop the demo cleanly, even when it was
    # started with SIGINT ignored (a shell's background job).
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupt)
    for name, value in DEMO_TIMINGS.items():
        os.environ.setdefault(f"CELERY_EXT_{name}", value)
    server: RedisServer | None = None
    children: list[Child] = []
    try:
        broker_url = os.environ.get("CELERY_EXT_BROKER_URL")
        if not broker_url:
            server = RedisServer().start()
            broker_url = server.url(scheme="celery-ext")
        os.environ["CELERY_EXT_BROKER_URL"] = broker_url
        sys.path.insert(0, str(ROOT))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        log_dir = Path(tempfile.mkdtemp(prefix="celery-ext-demo-"))
        return _run(args, broker_url, env, log_dir, children, server)
    finally:
        _stop(children, server)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(args: argparse.Namespace, broker_url: str, env: dict[str, str], log_dir: Path,
         children: list[Child], server: RedisServer | None) -> int:
    celery = [sys.executable, "-m", "celery", "-A", APP]
    web_port, flower_port = _pick_port(args.web_port), _pick_port(args.flower_port)

    def pool(node: str) -> Child:
        return Child(node, [*celery, "worker", "-P", "prefork", "-c", str(args.concurrency),
                            "-E", "-n", f"{node}@%h", "--loglevel=INFO"], env, log_dir)

    workers = [pool(node) for node in NODES]
    children += workers
    web = Child("dashboard", [*celery, "ext", "web", "--port", str(web_port)], env, log_dir)
    flower = Child("flower", [*celery, "flower", f"--port={flower_port}",
                              "--address=127.0.0.1"], env, log_dir)
    children += [web, flower]
    web_url, flower_url = f"http://127.0.0.1:{web_port}/", f"http://127.0.0.1:{flower_port}/"

    settings = Settings.load()
    client = client_from_url(broker_url)
    state = State(client, settings)
    started = time.monotonic()
    print(f"starting the server, worker pools {' and '.join(NODES)}, the dashboard and "
          f"Flower (logs in {log_dir})", flush=True)

    def pools_by_pid() -> dict[int, str]:
        return {p["pid"]: p["pool_id"] for p in state.worker_pools()
                if p["pid"] is not None and p["state"] == "running"}

    _wait("both worker pools to register",
          lambda: all(w.pid in pools_by_pid() for w in workers), children, START_TIMEOUT)
    _wait("the dashboard", lambda: _answers(web_url + "api/health"), children, START_TIMEOUT)
    _wait("Flower", lambda: _answers(flower_url), children, START_TIMEOUT)
    ids = pools_by_pid()
    pool_of = {w.name: ids[w.pid] for w in workers}

    cmd = " ".join([f"CELERY_EXT_BROKER_URL={shlex.quote(broker_url)}",
                    *map(shlex.quote, _celery_cmd())])
    header = [
        f"celery_ext demo: ready in {time.monotonic() - started:.1f}s; Ctrl-C stops everything",
        f"  broker     {broker_url}" + ("  (embedded server)" if server is not None else ""),
        f"  dashboard  {web_url}",
        f"  flower     {flower_url}",
        f"  pools      {', '.join(f'{w.name} (pid {w.pid})' for w in workers)}, "
        f"{args.concurrency} slots each",
        "try, from the repository root:",
        f"  {cmd} ext status",
        f"  {cmd} ext pools",
        f"  {cmd} ext dead ls",
        f"  {cmd} inspect active",
        f"  curl {web_url}api/health",
        f"jobs: {args.rate:g}/s of short, long (checking in), flaky (retrying, some into the "
        f"dead set), scheduled, unique and rate-limited; pool demo-b is SIGKILLed after "
        f"{args.kill_after:g}s",
    ]
    out = Out(header, sys.stdout.isatty())
    if not out.tty:
        print("\n".join(header), flush=True)

    producer = Producer(args.rate)
    from tasks import app

    produce_start = time.monotonic()
    last_status = last_poll = 0.0
    recovery: Recovery | None = None
    kill_asked: float | None = None
    victim = workers[1]
    while True:
        now = time.monotonic()
        producer.tick(now)
        for child in children:
            if child is not victim and not child.running:
                raise RuntimeError(f"{child.name} exited with code {child.proc.returncode}:"
                                   f"\n{child.log_tail()}")
        if recovery is None and now - produce_start >= args.kill_after:
            kill_asked = kill_asked or now
            if _runs_long_job(state, pool_of[victim.name], producer.tasks.build_report) \
                    or now - kill_asked > KILL_WAIT:
                victim.kill_group()
                victim.proc.wait()
                recovery = Recovery.snapshot(state, pool_of[victim.name], victim.name)
                recovery.note_results(app)
                out.event(f"SIGKILLed pool {victim.name} (process group {victim.pid}): it owned "
                          f"{len(recovery.jobs)} job(s) in flight: "
                          + ", ".join(job_label(n, j) for j, n in recovery.jobs.values()))
        if recovery is not None and not recovery.done and now - last_poll >= 0.3:
            last_poll = now
            recovery.poll(app, out)
            if recovery.done:  # a supervisor (systemd, compose) would start it again
                children.remove(victim)
                victim = pool(victim.name)
                children.append(victim)
                out.event(f"started a new pool {victim.name} (pid {victim.pid})")
        if now - last_status >= (1.0 if out.tty else args.status_every):
            last_status = now
            if out.tty:
                out.screen([_summary(state), "", *_status_lines(state)])
            else:
                out.event(_summary(state) + f"  (sent {sum(producer.sent.values())}, "
                          f"{producer.deduplicated} unique duplicates dropped)")
        time.sleep(0.05)


def _stop(children: list[Child], server: RedisServer | None) -> None:
    """Stop every child (SIGTERM to its group, SIGKILL after ``STOP_TIMEOUT``), then
    the server. A second Ctrl-C (or SIGTERM) SIGKILLs the children at once."""

    def force(signum: int, frame: object) -> None:
        for child in children:
            child.kill_group()

    for sig in STOP_SIGNALS:
        signal.signal(sig, force)
    _say("\nstopping: " + ", ".join(c.name for c in children if c.running))
    for child in children:
        if child.running:
            child.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT
    unclean = [child.name for child in children if not child.wait_stopped(deadline)]
    if server is not None:
        server.stop()
    _say("stopped" + (f" ({', '.join(unclean)} SIGKILLed after {STOP_TIMEOUT:.0f}s)"
                      if unclean else "") + ": nothing left running")


def _say(text: str) -> None:
    """Print while stopping: the terminal may be gone (SIGHUP), the stop goes on."""
    with contextlib.suppress(OSError):
        print(text, flush=True)


def run() -> int:
    try:
        return main()
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(run())
