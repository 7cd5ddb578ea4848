"""``python -m bench.result_backend``: Celery's Redis result backend vs celery-ext's, side by side.

One fresh server; the broker is ``celery-ext://`` (db 0) for both sides, so only the result
backend differs: Celery's ``redis://`` (db 1) and ours ``celery-ext://`` (db 2). Per side,
one prefork worker (``-c 2``) and this process as the client:

- **get() round trip**: ``add.delay(i, i).get()`` one after another (``--gets``): p50, p99
  in ms (the broker's trip is the same on both sides);
- **store + fetch**: ``--results`` results stored through the backend from this process,
  then read back with ``GroupResult.join_native`` (seconds each);
- **memory per result**: the server's ``used_memory`` growth over those results, in bytes;
- **chord**: a chord of ``--chord`` header jobs, seconds from apply to the body's result;
- **waiting on a group**: the pub/sub channels one client holds while it waits on a group
  of ``--group`` results (Celery's backend: one per result).

Sizes default to the issue's (10,000 results, a chord of 1,000); ``--quick`` shrinks them for
a smoke run. Prints a table, writes ``OUT/results.json``; worker logs in ``OUT/logs``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness import REPO_ROOT, median, percentile
from celery_ext.testing.server import RedisServer

DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "result_backend"
SIDES = {"celery": ("redis", 1), "ours": ("celery-ext", 2)}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.result_backend", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gets", type=int, default=300)
    p.add_argument("--results", type=int, default=10_000)
    p.add_argument("--chord", type=int, default=1_000)
    p.add_argument("--group", type=int, default=1_000)
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.gets, args.results, args.chord, args.group = 30, 300, 50, 100
    return args


def run_side(name: str, server: RedisServer, args: argparse.Namespace) -> dict[str, Any]:
    scheme, db = SIDES[name]
    broker = server.url(scheme="celery-ext", db=0)
    backend = server.url(scheme=scheme, db=db)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CELERY_EXT_")},
           "BENCH_BROKER_URL": broker, "BENCH_RESULT_BACKEND": backend,
           "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    os.environ.update(BENCH_BROKER_URL=broker, BENCH_RESULT_BACKEND=backend)
    from celery import chord, group

    import bench.result_backend_app as mod

    app = mod.app
    app.conf.broker_url, app.conf.result_backend = broker, backend
    app._backend = app._get_backend()
    app._pool = None
    app.amqp._producer_pool = None
    log = args.out / "logs" / f"worker-{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "bench.result_backend_app", "worker", "-c", "2",
             "-n", f"{name}@%h", "--without-gossip", "--without-mingle", "-l", "WARNING"],
            cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        mod.add.delay(0, 0).get(timeout=60)  # the worker is up
        row: dict[str, Any] = {"side": name}
        times = []
        for i in range(args.gets):
            t0 = time.perf_counter()
            mod.add.delay(i, i).get(timeout=30)
            times.append((time.perf_counter() - t0) * 1000)
        row["get_p50_ms"], row["get_p99_ms"] = median(times), percentile(times, 99)

        client = server.client(db=db)
        ids = [uuid.uuid4().hex for _ in range(args.results)]
        t0 = time.perf_counter()
        for i, task_id in enumerate(ids):
            app.backend.store_result(task_id, i, "SUCCESS")
        row["store_s"] = time.perf_counter() - t0
        sample = ids[:: max(1, len(ids) // 200)]  # MEMORY USAGE of a sample of the keys
        row["bytes_per_result"] = sum(
            int(client.memory_usage(app.backend.get_key_for_task(t)) or 0) for t in sample
        ) / len(sample)
        t0 = time.perf_counter()
        fetched = app.GroupResult(uuid.uuid4().hex,
                                  [app.AsyncResult(t) for t in ids]).join_native(timeout=120)
        row["fetch_s"] = time.perf_counter() - t0
        assert fetched == list(range(args.results))

        t0 = time.perf_counter()
        assert chord(mod.add.s(i, 0) for i in range(args.chord))(mod.total.s()).get(
            timeout=600) == sum(range(args.chord))
        row["chord_s"] = time.perf_counter() - t0

        res = group(mod.add.s(i, 0) for i in range(args.group)).delay()
        pattern = "celery-task-meta-*" if name == "celery" else "{celery_ext:client:*"
        most = [0]
        waiting = threading.Event()

        def sample_channels() -> None:  # the most result channels seen while it waits
            while not waiting.is_set():
                most[0] = max(most[0], len(client.pubsub_channels(pattern)))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample_channels)
        sampler.start()
        try:
            res.get(timeout=600)
        finally:
            waiting.set()
            sampler.join()
        row["channels_waiting"] = most[0]
        return row
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with RedisServer() as server:
        rows = [run_side(name, server, args) for name in SIDES]
    keys = [k for k in rows[0] if k != "side"]
    print(f"{'':20}" + "".join(f"{r['side']:>12}" for r in rows))
    for k in keys:
        print(f"{k:20}" + "".join(f"{r[k]:>12.2f}" if isinstance(r[k], float)
                                  else f"{r[k]!s:>12}" for r in rows))
    (args.out / "results.json").write_text(json.dumps(
        {"args": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows},
        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
