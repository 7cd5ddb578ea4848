"""``python -m celery_ext.demo``: everything celery_ext does, running, until Ctrl-C.

It starts (each in its own process group, so a Ctrl-C reaches only this process,
which then stops them in order):

- an embedded Valkey/Redis server, unless ``CELERY_EXT_BROKER_URL`` names one;
- two worker pools, ``celery -A celery_ext.demo.app worker`` subprocesses (``demo-a``,
  ``demo-b``), which also run the app's periodic job (its ``beat_schedule``);
- the dashboard (``celery -A celery_ext.demo.app ext web``) and, when Flower is
  installed, Flower (``celery -A celery_ext.demo.app flower`` with the demo's
  ``flowerconfig.py``, whose line gives it our broker page: :mod:`celery_ext.admin.flower`).

The app and its config ship in the package (:mod:`celery_ext.demo.app`), so the demo
runs from an installed wheel in any folder. It prints the URLs and the commands to try
(with the broker URL filled in), then enqueues the example jobs at a steady rate:
short, long (checking in), flaky (retrying, some into the dead set), scheduled
(countdown), unique and rate-limited. After ``--kill-after`` seconds it SIGKILLs pool
``demo-b`` and shows, read from Redis, the jobs that pool owned being requeued by the
reaper in ``demo-a`` and run there. Ctrl-C stops everything: producer, dashboard and
Flower, the pools (warm shutdown: a long job learns it at its next checkin), the
server. With ``--seconds N`` it stops by itself after N seconds of jobs, and exits 0
only if jobs finished and the periodic job ran by then, or within ``--verdict-wait``
seconds more (CI runs it so).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from celery_ext.client import Client
from celery_ext.config import DEMO_VERDICT_WAIT
from celery_ext.demo.children import Child, answers, pick_port, wait_until
from celery_ext.demo.producer import Producer
from celery_ext.demo.recovery import Recovery
from celery_ext.demo.show import Out, finished, job_label, periodic_runs, status_lines, summary
from celery_ext.testing.server import RedisServer

#: The example app every process of the demo loads (it ships in the package).
APP = "celery_ext.demo.app"
#: What the example jobs' names start with (Celery names a task after its module).
JOB_PREFIX = f"{APP}."
#: Flower's config file for the demo: the one line that gives Flower our broker page.
FLOWER_CONFIG = Path(__file__).with_name("flowerconfig.py")
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

__all__ = ["job_label", "main", "run"]


def _runs_long_job(admin: Client, pool_id: str, task: Any) -> bool:
    """Does the pool run a job of ``task`` (a long one, there to show running on) with
    a step done (its cursor: the recovered run resumes after it) and half of it or more
    still to go? One near its end can finish and be acked between this read and the
    kill, which then finds the pool owning nothing to recover."""
    return any(b["pool_id"] == pool_id and b["job_name"] == task.name
               and b["progress"] is not None and b["progress"] < 0.5
               for b in admin.busy_workers())


# -- the demo ----------------------------------------------------------------------------
def _celery_cmd() -> list[str]:
    """How to run ``celery`` as printed for the user: this Python's, relative to the
    current folder when it is inside it."""
    exe = Path(sys.executable)
    try:
        shown = str(exe.relative_to(Path.cwd()))
    except ValueError:
        shown = str(exe)
    return [shown, "-m", "celery", "-A", APP]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m celery_ext.demo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=4.0, help="jobs enqueued per second")
    parser.add_argument("--kill-after", type=float, default=20.0,
                        help="seconds of producing before pool demo-b is SIGKILLed")
    parser.add_argument("--seconds", type=float, default=0.0,
                        help="stop after this many seconds of producing and exit 0 only if "
                             "jobs finished and the periodic job ran (0: until Ctrl-C)")
    parser.add_argument("--verdict-wait", type=float, default=DEMO_VERDICT_WAIT,
                        help="with --seconds: most seconds to wait, past its end, for a job "
                             "to finish and the periodic job to run before the run fails")
    parser.add_argument("--concurrency", type=int, default=4, help="slots per worker pool")
    parser.add_argument("--web-port", type=int, default=5040, help="0: any free port")
    parser.add_argument("--flower-port", type=int, default=5555, help="0: any free port")
    parser.add_argument("--status-every", type=float, default=3.0,
                        help="seconds between status lines when not on a terminal")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.concurrency < 1 or args.seconds < 0 or args.verdict_wait < 0:
        parser.error("--rate must be positive, --concurrency at least 1, --seconds and "
                     "--verdict-wait >= 0")

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
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        log_dir = Path(tempfile.mkdtemp(prefix="celery-ext-demo-"))
        demo = Demo(args, broker_url, env, log_dir, children)
        demo.start(server)
        return demo.loop()
    finally:
        _stop(children, server)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class Demo:
    """The running demo: its children (``children`` is the caller's list, which stops
    them whatever happens), the admin client, the producer and the kill/recovery."""

    def __init__(self, args: argparse.Namespace, broker_url: str, env: dict[str, str],
                 log_dir: Path, children: list[Child]) -> None:
        self.args = args
        self.broker_url = broker_url
        self.env = env
        self.log_dir = log_dir
        self.children = children
        self.celery = [sys.executable, "-m", "celery", "-A", APP]
        self.admin = Client.from_url(broker_url)
        self.with_flower = importlib.util.find_spec("flower") is not None
        self.workers: list[Child] = []
        self.pool_of: dict[str, str] = {}
        self.out = Out([], sys.stdout.isatty())

    def pool(self, node: str) -> Child:
        return Child(node, [*self.celery, "worker", "-P", "prefork", "-c",
                            str(self.args.concurrency), "-E", "-n", f"{node}@%h",
                            "--loglevel=INFO"], self.env, self.log_dir)

    def _pools_by_pid(self) -> dict[int, str]:
        return {p["pid"]: p["pool_id"] for p in self.admin.worker_pools()
                if p["pid"] is not None and p["state"] == "running"}

    def start(self, server: RedisServer | None) -> None:
        """Start the pools, the dashboard and Flower; wait until each answers."""
        args, children = self.args, self.children
        web_port, flower_port = pick_port(args.web_port), pick_port(args.flower_port)
        self.workers = [self.pool(node) for node in NODES]
        children += self.workers
        children.append(Child("dashboard", [*self.celery, "ext", "web", "--port",
                                            str(web_port)], self.env, self.log_dir))
        web_url, flower_url = f"http://127.0.0.1:{web_port}/", f"http://127.0.0.1:{flower_port}/"
        if self.with_flower:
            children.append(Child("flower", [
                *self.celery, "flower", f"--port={flower_port}", "--address=127.0.0.1",
                f"--conf={FLOWER_CONFIG}"], self.env, self.log_dir))
        started = time.monotonic()
        print(f"starting the server, worker pools {' and '.join(NODES)}, the dashboard"
              f"{' and Flower' if self.with_flower else ''} (logs in {self.log_dir})",
              flush=True)
        wait_until("both worker pools to register",
                   lambda: all(w.pid in self._pools_by_pid() for w in self.workers), children,
                   START_TIMEOUT)
        wait_until("the dashboard", lambda: answers(web_url + "api/health"), children,
                   START_TIMEOUT)
        if self.with_flower:
            wait_until("Flower", lambda: answers(flower_url), children, START_TIMEOUT)
        ids = self._pools_by_pid()
        self.pool_of = {w.name: ids[w.pid] for w in self.workers}
        self.out.started = time.monotonic()
        self.out.header = self._header(time.monotonic() - started, server, web_url,
                                       flower_url)
        if not self.out.tty:
            print("\n".join(self.out.header), flush=True)

    def _header(self, ready_after: float, server: RedisServer | None, web_url: str,
                flower_url: str) -> list[str]:
        args = self.args
        cmd = " ".join([f"CELERY_EXT_BROKER_URL={shlex.quote(self.broker_url)}",
                        *map(shlex.quote, _celery_cmd())])
        stop = (f"stops by itself after {args.seconds:g}s of jobs" if args.seconds
                else "Ctrl-C stops everything")
        return [
            f"celery_ext demo: ready in {ready_after:.1f}s; {stop}",
            f"  broker     {self.broker_url}"
            + ("  (embedded server)" if server is not None else ""),
            f"  dashboard  {web_url}",
            f"  flower     {flower_url}" if self.with_flower
            else "  flower     not installed (pip install 'celery-ext[flower]')",
            f"  pools      {', '.join(f'{w.name} (pid {w.pid})' for w in self.workers)}, "
            f"{args.concurrency} slots each",
            "try, from this folder:",
            f"  {cmd} ext status",
            f"  {cmd} ext pools",
            f"  {cmd} ext dead ls",
            f"  {cmd} inspect active",
            f"  curl {web_url}api/health",
            f"jobs: {args.rate:g}/s of short, long (checking in), flaky (retrying, some into "
            f"the dead set), scheduled, unique and rate-limited; a periodic one every 10 s; "
            + (f"pool demo-b is SIGKILLed after {args.kill_after:g}s"
               if not args.seconds or args.kill_after < args.seconds
               else "no pool is killed (--kill-after is past --seconds)"),
        ]

    def loop(self) -> int:
        """Produce, kill, follow the recovery and show the status, until Ctrl-C (or
        ``--seconds``: then the verdict is the exit status)."""
        args, out = self.args, self.out
        producer = Producer(args.rate)
        from celery_ext.demo.app import app

        produce_start = time.monotonic()
        last_status = last_poll = 0.0
        recovery: Recovery | None = None
        kill_asked: float | None = None
        victim = self.workers[1]
        while True:
            now = time.monotonic()
            if args.seconds and now - produce_start >= args.seconds:
                return self.verdict(now - produce_start)
            producer.tick(now)
            for child in self.children:
                if child is not victim and not child.running:
                    raise RuntimeError(f"{child.name} exited with code "
                                       f"{child.proc.returncode}:\n{child.log_tail()}")
            if recovery is None and now - produce_start >= args.kill_after:
                kill_asked = kill_asked or now
                if _runs_long_job(self.admin, self.pool_of[victim.name],
                                  producer.jobs.build_report) or now - kill_asked > KILL_WAIT:
                    recovery = self.kill(victim, app)
            if recovery is not None and not recovery.done and now - last_poll >= 0.3:
                last_poll = now
                recovery.poll(app, out)
                if recovery.done:  # a supervisor (systemd, compose) would start it again
                    self.children.remove(victim)
                    victim = self.pool(victim.name)
                    self.children.append(victim)
                    out.event(f"started a new pool {victim.name} (pid {victim.pid})")
            if now - last_status >= (1.0 if out.tty else args.status_every):
                last_status = now
                if out.tty:
                    out.screen([summary(self.admin, JOB_PREFIX), "",
                                *status_lines(self.admin, JOB_PREFIX)])
                else:
                    out.event(summary(self.admin, JOB_PREFIX)
                              + f"  (sent {sum(producer.sent.values())}, "
                              f"{producer.deduplicated} unique duplicates dropped)")
            time.sleep(0.05)

    def kill(self, victim: Child, app: Any) -> Recovery:
        """SIGKILL ``victim``'s process group; the recovery to follow."""
        victim.kill_group()
        victim.proc.wait()
        recovery = Recovery.snapshot(self.admin, self.pool_of[victim.name], victim.name)
        recovery.note_results(app)
        self.out.event(f"SIGKILLed pool {victim.name} (process group {victim.pid}): it owned "
                       f"{len(recovery.jobs)} job(s) in flight: "
                       + ", ".join(job_label(n, j) for j, n in recovery.jobs.values()))
        return recovery

    def verdict(self, ran_for: float) -> int:
        """0 if jobs finished and the periodic job ran, waiting at most ``--verdict-wait``
        more seconds for the latter (its run may be due just now); else 1."""
        deadline = time.monotonic() + self.args.verdict_wait
        while True:
            done, runs = finished(self.admin, JOB_PREFIX), periodic_runs(self.admin)
            if (done and runs) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        ok = bool(done and runs)
        self.out.event(f"{'ok' if ok else 'FAILED'} after {ran_for:.0f}s of jobs: {done} "
                       f"job(s) finished, {runs} periodic run(s) done")
        return 0 if ok else 1


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
