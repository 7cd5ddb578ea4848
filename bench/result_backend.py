"""``python -m bench.result_backend``: Celery's Redis result backend vs celery-ext's, side by side.

One fresh server; the broker is ``celery-ext://`` (db 0) for both sides, so only the result
backend differs: Celery's ``redis://`` (db 1) and ours ``celery-ext://`` (db 2). Per side,
one prefork worker (``-c 2``) and this process as the client:

- **get() round trip**: ``add.delay(i, i).get()`` one after another (``--gets``): p50, p99
  in ms (the broker's trip is the same on both sides);
- **store + fetch**: ``--results`` results stored through the backend from this process,
  then read back with ``GroupResult.join_native`` (seconds each);
- **memory per result**: ``MEMORY USAGE`` of a sample of the result keys, and the server's
  ``used_memory`` growth over those results divided by their number, in bytes;
- **chord**: a chord of ``--chord`` header jobs, seconds from apply to the body's result;
- **waiting on a group**: the pub/sub channels one client holds while it waits on a group
  of ``--group`` results (Celery's backend: one per result);
- **client processes waiting at once**: with the worker stopped, ``--clients`` processes
  each send a group of ``--client-results`` jobs and wait on it; while all of them wait,
  the server's view: connections those processes hold (``CLIENT LIST`` against the count
  before they started), how many of them are subscribed, the channels (``PUBSUB CHANNELS``
  and ``SHARDCHANNELS``) and subscriptions (``NUMSUB`` / ``SHARDNUMSUB`` summed); then the
  worker starts again and the seconds until every client has its results.

Sizes default to the issue's (10,000 results, a chord of 1,000, 4 clients each waiting on
1,000); ``--quick`` shrinks them for a smoke run. Prints a table and the load average,
writes ``OUT/results.json``; worker logs in ``OUT/logs``. ``--wait-client`` is the client
process's own entry point.
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
    p.add_argument("--gets", type=int, default=500)
    p.add_argument("--results", type=int, default=10_000)
    p.add_argument("--chord", type=int, default=1_000)
    p.add_argument("--group", type=int, default=1_000)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--client-results", type=int, default=1_000)
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--wait-client", metavar="READY_URL", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.gets, args.results, args.chord, args.group = 30, 300, 50, 100
        args.clients, args.client_results = 2, 100
    return args


def wait_client(ready_url: str, n: int) -> int:
    """One client process: send a group of ``n`` jobs, say so, wait on its results."""
    import redis
    from celery import group

    import bench.result_backend_app as mod

    res = group(mod.add.s(i, 0) for i in range(n)).delay()
    redis.Redis.from_url(ready_url).rpush("bench:ready", os.getpid())
    return 0 if res.get(timeout=600) == list(range(n)) else 1


def start_worker(name: str, env: dict[str, str], out_dir: Path,
                 app: str = "bench.result_backend_app") -> subprocess.Popen[bytes]:
    log = out_dir / "logs" / f"worker-{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", app, "worker", "-c", "2",
             "-n", f"{name}@%h", "--without-gossip", "--without-mingle", "-l", "WARNING"],
            cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)


def stop_worker(worker: subprocess.Popen[bytes]) -> None:
    worker.terminate()
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait(30)


def server_view(client: Any) -> dict[str, int]:
    """Connections, subscribed connections, channels and subscriptions on the server now."""
    conns = client.client_list()
    subscribed = sum(1 for c in conns if any(int(c.get(k) or 0) for k in ("sub", "ssub", "psub")))
    channels = client.pubsub_channels()
    shard = client.execute_command("PUBSUB SHARDCHANNELS")
    subs = sum(n for _, n in client.pubsub_numsub(*channels)) if channels else 0
    if shard:
        reply = client.execute_command("PUBSUB SHARDNUMSUB", *shard)
        subs += sum(int(n) for n in reply[1::2])
    return {"connections": len(conns), "subscribed": subscribed,
            "channels": len(channels) + len(shard), "subscriptions": subs}


def run_clients(name: str, server: RedisServer, env: dict[str, str],
                args: argparse.Namespace) -> dict[str, Any]:
    """``--clients`` processes waiting at once (the worker is stopped): what the server holds."""
    control = server.client(db=3)
    control.delete("bench:ready")
    before = server_view(control)
    procs = [subprocess.Popen([sys.executable, "-m", "bench.result_backend", "--wait-client",
                               server.url(db=3), "--client-results", str(args.client_results)],
                              cwd=REPO_ROOT, env=env) for _ in range(args.clients)]
    try:
        deadline = time.monotonic() + 300
        while control.llen("bench:ready") < args.clients:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{name}: the waiting clients did not all send their jobs")
            time.sleep(0.05)
        most = dict.fromkeys(before, 0)
        for _ in range(40):  # 2 s: every client is in its get() and subscribed by then
            for k, v in server_view(control).items():
                most[k] = max(most[k], v)
            time.sleep(0.05)
        worker = start_worker(f"{name}-clients", env, args.out)
        t0 = time.perf_counter()
        try:
            codes = [p.wait(600) for p in procs]
        finally:
            stop_worker(worker)
        if any(codes):
            raise RuntimeError(f"{name}: a waiting client failed ({codes})")
        return {"clients_s": time.perf_counter() - t0,
                "clients_connections": most["connections"] - before["connections"],
                "clients_subscribed_conns": most["subscribed"] - before["subscribed"],
                "clients_channels": most["channels"] - before["channels"],
                "clients_subscriptions": most["subscriptions"] - before["subscriptions"]}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)


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
    worker = start_worker(name, env, args.out)
    stopped = False
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
        used = int(client.info("memory")["used_memory"])
        t0 = time.perf_counter()
        for i, task_id in enumerate(ids):
            app.backend.store_result(task_id, i, "SUCCESS")
        row["store_s"] = time.perf_counter() - t0
        row["used_memory_per_result"] = (
            int(client.info("memory")["used_memory"]) - used) / len(ids)
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
        stop_worker(worker)
        stopped = True
        row.update(run_clients(name, server, env, args))
        return row
    finally:
        if not stopped:
            stop_worker(worker)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.wait_client:
        return wait_client(args.wait_client, args.client_results)
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    with RedisServer() as server:
        rows = [run_side(name, server, args) for name in SIDES]
    load_after = os.getloadavg()
    keys = [k for k in rows[0] if k != "side"]
    print(f"{'':26}" + "".join(f"{r['side']:>12}" for r in rows))
    for k in keys:
        print(f"{k:26}" + "".join(f"{r[k]:>12.2f}" if isinstance(r[k], float)
                                  else f"{r[k]!s:>12}" for r in rows))
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    (args.out / "results.json").write_text(json.dumps(
        {"args": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows,
         "load_before": load_before, "load_after": load_after}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
