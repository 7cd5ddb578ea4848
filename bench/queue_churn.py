"""What job queue names that come and go leave in Redis (issue 33, item 13).

One side per topology (one node, a 3-master cluster). A worker (``bench.app`` with
``BENCH_QUEUES=N``: one job name spread over N job queues, all consumed) runs one job
of each of N queues and stops; then one reader pass runs (``Client.job_queues()``: what
the dashboard, the CLI and the requeuer's history sample run). Counted after the drain,
after the reader and, on a cluster, after the job index's finished entries expired
(``--index-ttl``) and the reaper trimmed them, then another reader pass:

- ``registry``: names in ``{ns}:queues`` (the home copy's on a cluster),
- ``fields``: per-queue fields of ``{ns}:stats``, ``{ns}:runtime`` and ``{ns}:running``,
  every copy,
- ``keys``: keys of the namespace (every master), and by kind (``key_kinds``: the part
  of the key after the tag, such as ``published`` for the publish markers, which expire
  after ``publish_idempotency_ttl``),
- ``bytes``: ``MEMORY USAGE`` of the home registry, stats, runtime and running hashes,
- ``trim_scripts``: scripts one reaper pass runs to trim the job index (one per copy
  of the layout that ``copies()`` finds; the requeuer's promote pass is the same size).

    PYTHONPATH=. python -m bench.queue_churn --queues 2000

(Put another version's ``celery_ext`` first on ``PYTHONPATH`` to measure it.)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import redis
from celery import Celery

import celery_ext
from celery_ext.client import Client
from celery_ext.config import Settings
from celery_ext.store.copies import copies
from celery_ext.testing.server import ClusterGroup, RedisServer
from celery_ext.worker.reaper import Reaper

REPO_ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "churn"
JOB = "bench.job_0000"  # bench.app's one job name when BENCH_QUEUES is set


def queue_names(n: int) -> list[str]:
    return [f"bench.q_{i:04d}" for i in range(n)]


def count(ext: Client, masters: list[RedisServer], names: set[str]) -> dict[str, Any]:
    """The figures of one moment (see the module's docstring)."""
    k, client = ext.keys, ext.client
    fields = 0
    for copy in {k, *(k.of(n) for n in names)}:
        for hash_key in (copy.stats, copy.runtime):
            fields += sum(1 for f in client.hkeys(hash_key)
                          if f.decode().partition(":")[2] in names)
        fields += sum(1 for f in client.hkeys(copy.running) if f.decode() in names)
    kinds: dict[str, int] = {}
    for m in masters:
        for key in m.client().scan_iter(match="{" + NAMESPACE + "*", count=1000):
            kind = key.decode().split("}:", 1)[1].split(":", 1)[0]
            if kind.startswith("_kombu."):  # Kombu's binding tables, one per exchange
                kind = kind.split(".")[0] + "." + kind.split(".")[1]
            kinds[kind] = kinds.get(kind, 0) + 1
    used = sum(int(client.memory_usage(key) or 0)
               for key in (k.queues, k.stats, k.runtime, k.running))
    return {"registry": int(client.scard(k.queues)), "fields": fields,
            "keys": sum(kinds.values()), "bytes": used, "trim_scripts": len(copies(client, k)),
            "key_kinds": dict(sorted(kinds.items()))}


def run_side(url: str, masters: list[RedisServer], counter_url: str, cluster: bool,
             n: int, index_ttl: float, log: Path) -> dict[str, Any]:
    names = queue_names(n)
    options: dict[str, Any] = {"namespace": NAMESPACE, "job_index_ttl": index_ttl}
    if cluster:
        options["cluster"] = True
    env = {**os.environ, "BENCH_MODE": "ours", "BENCH_BROKER_URL": url,
           "BENCH_QUEUES": str(n), "BENCH_CLUSTER": "1" if cluster else "0",
           "BENCH_COUNTER_URL": counter_url,
           "CELERY_EXT_NAMESPACE": NAMESPACE, "CELERY_EXT_CLUSTER": "1" if cluster else "0",
           "CELERY_EXT_JOB_INDEX_TTL": str(index_ttl),
           "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"),
                                                      str(REPO_ROOT)) if p)}
    counter = redis.Redis.from_url(counter_url)
    counter.delete("bench:done", "bench:ready")
    with open(log, "w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "bench.app", "worker", "-P", "solo",
             "--loglevel=WARNING", "-n", f"churn{os.getpid()}@%h"],
            env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not counter.scard("bench:ready"):
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start; see {log}")
            time.sleep(0.2)
        app = Celery("churn-producer", broker=url, set_as_current=False)
        app.conf.broker_transport_options = options
        app.conf.task_ignore_result = True
        celery_ext.install(app)
        t0 = time.perf_counter()
        for name in names:
            app.send_task(JOB, queue=name)
        while int(counter.get("bench:done") or 0) < n:
            if time.monotonic() > deadline + n / 20:
                raise RuntimeError(f"the jobs did not all run; see {log}")
            time.sleep(0.2)
        drained = time.perf_counter() - t0
        time.sleep(1.5)  # the worker's last counter flush (once a second)
        app.close()
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
    ext = Client.from_url(url, **options)
    try:
        result: dict[str, Any] = {"queues": n, "drain_s": round(drained, 1),
                                  "after_drain": count(ext, masters, set(names))}
        t = time.perf_counter()
        ext.job_queues()
        result["reader_s"] = round(time.perf_counter() - t, 2)
        result["after_reader"] = count(ext, masters, set(names))
        if cluster:
            time.sleep(index_ttl + 0.5)
            reaper = Reaper(ext.client, Settings.load(options))
            while reaper.trim_index():
                pass
            ext.job_queues()
            result["after_index_ttl"] = count(ext, masters, set(names))
        return result
    finally:
        ext.client.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queues", type=int, default=2000)
    parser.add_argument("--index-ttl", type=float, default=2.0,
                        help="job_index_ttl (s): finished entries keep a cluster copy known")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    with ExitStack() as stack:
        one = stack.enter_context(RedisServer(appendonly=False))
        counter = one.url(db=2)
        results["one_node"] = run_side(one.url(scheme="celery-ext"), [one], counter, False,
                                       args.queues, args.index_ttl,
                                       args.out / "queue_churn-one_node.log")
        print("one node:", json.dumps(results["one_node"]), flush=True)
        group = stack.enter_context(ClusterGroup(masters=3))
        results["cluster"] = run_side(group.url(), group.master_servers(), counter, True,
                                      args.queues, args.index_ttl,
                                      args.out / "queue_churn-cluster.log")
        print("cluster:", json.dumps(results["cluster"]), flush=True)
    (args.out / "queue_churn.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
