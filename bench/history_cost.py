"""What the Redis history costs: memory of its buckets and CPU per job of its writes.

``python -m bench.history_cost [--names 1,10,100] [--jobs-per-flush 1,10,100]``

On a freshly started server (``celery_ext.testing.server.RedisServer``):

* **memory**: one minute hash and one hour hash filled as a busy one would be (every job
  name active with runtimes spread over 8 histogram buckets, plus the queue-size
  sample), measured with ``MEMORY USAGE``; the bound is 1,441 minute hashes + 721 hour
  hashes of that size (``celery_ext.store.history``: 24 h and 30 days, plus the current one).
  A job adds no memory of its own: it increments a count in a hash that exists anyway.
* **CPU per job**: the executing process sums jobs in memory (``HistoryWriter.add``,
  timed here) and adds them to Redis once a second in one ``history`` script call;
  Redis CPU per call is read from ``INFO commandstats`` (EVALSHA), divided by the jobs
  that call carried. A process that runs fewer jobs per second pays the call for fewer.

The figures are provisional on a loaded machine: rerun on an idle one.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from celery_ext.config import Settings
from celery_ext.store.history import HistoryWriter
from celery_ext.store.keys import Keys
from celery_ext.testing.server import RedisServer

MINUTE_BUCKETS = 24 * 60 + 1
HOUR_BUCKETS = 30 * 24 + 1


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def evalsha_usec(client: Any) -> tuple[int, int]:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


def memory(client: Any, settings: Settings, names: int) -> dict[str, Any]:
    client.flushall()
    writer = HistoryWriter(client, settings)
    for n in range(names):
        for b in range(8):  # 8 buckets: 1 ms .. 128 ms
            writer.add(f"app.tasks.job_number_{n:04d}", "processed", 0.001 * 2 ** b)
        writer.add(f"app.tasks.job_number_{n:04d}", "failed", 0.05)
    writer.flush()
    writer.gauge({"queued": 123456, "in_flight": 64, "scheduled": 5000, "retry": 300,
                  "dead": 10000, "latency": 12.5})
    k = Keys.for_settings(settings)
    minute = next(iter(client.scan_iter(k.history_minute(0)[:-1] + "*")))
    hour = next(iter(client.scan_iter(k.history_hour(0)[:-1] + "*")))
    m_bytes = int(client.memory_usage(minute, samples=0))
    h_bytes = int(client.memory_usage(hour, samples=0))
    return {"names": names, "minute_hash_bytes": m_bytes, "hour_hash_bytes": h_bytes,
            "bound_bytes": m_bytes * MINUTE_BUCKETS + h_bytes * HOUR_BUCKETS,
            "encoding": client.object("encoding", minute).decode()}


def cpu(client: Any, settings: Settings, names: int, per_flush: int,
        flushes: int = 300) -> dict[str, Any]:
    client.flushall()
    writer = HistoryWriter(client, settings)
    job_names = [f"app.tasks.job_number_{n:04d}" for n in range(names)]
    client.config_resetstat()
    add_s = 0.0
    wall = 0.0
    for f in range(flushes):
        start = time.perf_counter()
        for j in range(per_flush):
            writer.add(job_names[(f * per_flush + j) % names], "processed", 0.003 * (j % 50))
        add_s += time.perf_counter() - start
        start = time.perf_counter()
        writer.flush()
        wall += time.perf_counter() - start
    calls, usec = evalsha_usec(client)
    jobs = flushes * per_flush
    return {"names": names, "jobs_per_flush": per_flush, "script_calls": calls,
            "redis_usec_per_call": round(usec / max(calls, 1), 1),
            "redis_usec_per_job": round(usec / jobs, 2),
            "python_add_usec_per_job": round(add_s / jobs * 1e6, 2),
            "flush_round_trip_usec": round(wall / flushes * 1e6, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", type=_ints, default=[1, 10, 100])
    parser.add_argument("--jobs-per-flush", type=_ints, default=[1, 10, 100, 1000])
    args = parser.parse_args(argv)
    settings = Settings()
    out: dict[str, Any] = {"memory": [], "cpu": []}
    with RedisServer() as server:
        client = server.client()
        for names in args.names:
            out["memory"].append(memory(client, settings, names))
        for names in args.names:
            for per_flush in args.jobs_per_flush:
                out["cpu"].append(cpu(client, settings, names, per_flush))
        client.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
