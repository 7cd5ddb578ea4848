"""``./dev demo``: a worker, the example jobs from ``tasks/``, and live progress.

With no ``CELERY_EXT_BROKER_URL`` an embedded Valkey/Redis server is started in a
temporary directory. A ``celery -A tasks worker`` subprocess runs the jobs; this
process enqueues short, long and flaky jobs and prints queues, busy workers with
their checkin progress, and the dead set until everything has settled.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .config import Settings
from .connections import client_from_url
from .server import RedisServer
from .state import State

ROOT = Path(__file__).resolve().parent.parent


def _render(state: State, started: float, results: dict[str, Any]) -> str:
    lines = [f"celery_ext demo  ({time.time() - started:5.1f}s)", ""]
    queues = [q for q in state.job_queues() if q["name"].startswith("tasks.")]
    lines.append(f"{'job queue':32} {'queued':>6} {'in flight':>9} {'done':>5} {'failed':>6}")
    for q in queues:
        lines.append(f"{q['name']:32} {q['size']:>6} {q['in_flight']:>9} "
                     f"{q['processed']:>5} {q['failed']:>6}")
    busy = state.busy_workers()
    lines += ["", f"busy workers: {len(busy)}"]
    for b in busy:
        progress = f"{b['progress'] * 100:5.1f}%" if b["progress"] is not None else "  -   "
        lines.append(f"  {b['job_name']:28} {progress} {b['checkin_message'] or ''}")
    dead = state.client.zcard(state.keys.dead)
    done = sum(1 for r in results.values() if r.ready())
    lines += ["", f"results ready: {done}/{len(results)}   dead set: {dead}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notices", type=int, default=40)
    parser.add_argument("--reports", type=int, default=3)
    parser.add_argument("--accounts", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=90.0)
    args = parser.parse_args(argv)

    server: RedisServer | None = None
    broker_url = os.environ.get("CELERY_EXT_BROKER_URL")
    if not broker_url:
        server = RedisServer().start()
        broker_url = server.url(scheme="celery-ext")
        print(f"started an embedded server: {server.url()}")
    os.environ["CELERY_EXT_BROKER_URL"] = broker_url
    sys.path.insert(0, str(ROOT))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log_path = Path(tempfile.gettempdir()) / "celery_ext_demo_worker.log"
    log = log_path.open("w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tasks", "worker", "-P", "prefork", "-c", "4",
         "--loglevel=INFO", "-n", "demo@%h"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        from tasks import build_report, send_notice, sync_account

        results: dict[str, Any] = {}
        for i in range(args.reports):
            results[f"report{i}"] = build_report.delay(i, steps=12)
        for i in range(args.notices):
            results[f"notice{i}"] = send_notice.delay(i)
        for i in range(args.accounts):
            results[f"account{i}"] = sync_account.delay(i, fail_rate=0.6)
        state = State(client_from_url(broker_url), Settings.load())
        started = time.time()
        tty = sys.stdout.isatty()
        while time.time() - started < args.timeout:
            screen = _render(state, started, results)
            print(("\033[H\033[J" if tty else "\n") + screen, flush=True)
            if all(r.ready() for r in results.values()):
                break
            time.sleep(0.5 if tty else 2.0)
        ok = sum(1 for r in results.values() if r.successful())
        print(f"\n{ok} jobs succeeded, {len(results) - ok} failed "
              f"(failed jobs are in the dead set: `celery -A tasks ext dead ls`).")
        print(f"worker log: {log.name}")
        return 0
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
        log.close()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
