"""``python -m bench.bulk``: bulk enqueue, ours against stock, in one process and one run.

One fresh server (AOF off: the publish path is measured, not the disk). Two Celery apps
in this process publish the same no-op task (``ignore_result=True``, no result backend):
**stock** on ``redis://`` (its queue routed by name, as the other workloads do) and
**ours** on ``celery-ext://`` with ``install(app)``. Alternating per round, each side runs:

- **group**: ``group(task.s(i) for i in range(N)).apply_async()`` (ours: the group is
  written in bulk, ``BULK_PIPELINE_SIZE`` jobs per round trip);
- **explicit**: ours ``task.apply_many([(i,) ...])``, stock its loop of ``apply_async``;
- **single**: a loop of ``apply_async`` on both sides (the single publish must not slip).

The database is flushed before each measured call. Reported: jobs/s (wall clock) and
client CPU µs per job, medians over rounds, and ours/stock. Then one bulk of
``--largest`` jobs (default 100,000) through ``apply_many`` with SLOWLOG recording every
call over ``--slowlog-us``: the largest single Redis call of the bulk, in ms, and the mean
EVALSHA from ``INFO commandstats``. The load average before and after is printed, as is
every setting; ``--out`` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from celery import Celery, group

import celery_ext
from celery_ext.config import BULK_PIPELINE_SIZE
from celery_ext.testing.node import RedisServer

TASK = "bench.bulk.noop"


def make_app(mode: str, url: str) -> Celery:
    app = Celery(f"bulk_{mode}", broker=url, set_as_current=False)
    app.conf.update(task_ignore_result=True, broker_connection_retry_on_startup=True)
    if mode == "ours":
        celery_ext.install(app)
    else:
        app.conf.task_routes = {TASK: {"queue": TASK}}

    @app.task(name=TASK, shared=False)
    def noop(i: int) -> None: ...

    return app


def workloads(app: Celery, mode: str) -> dict[str, Callable[[int], Any]]:
    task = app.tasks[TASK]

    def loop(n: int) -> None:
        for i in range(n):
            task.apply_async((i,))

    def explicit(n: int) -> None:
        if mode == "ours":
            task.apply_many([(i,) for i in range(n)])
        else:
            loop(n)

    return {"group": lambda n: group(task.s(i) for i in range(n)).apply_async(),
            "explicit": explicit, "single": loop}


def measure(fn: Callable[[int], Any], n: int) -> tuple[float, float]:
    """(jobs/s, client CPU µs per job) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn(n)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return n / wall, cpu / n * 1e6


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def largest_call(server: RedisServer, app: Celery, n: int, slower_than_us: int) -> dict[str, Any]:
    """One bulk of ``n`` jobs with SLOWLOG on: the longest call Redis ran for it."""
    with server.client() as client:
        client.flushall()
        client.config_set("slowlog-log-slower-than", slower_than_us)
        client.config_set("slowlog-max-len", 100_000)
        client.slowlog_reset()
        client.config_resetstat()
        wall = time.perf_counter()
        app.tasks[TASK].apply_many([(i,) for i in range(n)])
        wall = time.perf_counter() - wall
        entries = client.slowlog_get(100_000)
        stats = client.info("commandstats").get("cmdstat_evalsha", {})
        queued = client.llen(f"celery_ext:queue:{TASK}")
        client.config_set("slowlog-log-slower-than", 10_000)
    top = max(entries, key=lambda e: e["duration"], default=None)
    longest = top["duration"] if top else 0
    command = top["command"].split()[0].decode() if top else ""
    return {"jobs": n, "queued": queued, "seconds": round(wall, 2),
            "slowlog_threshold_us": slower_than_us, "calls_over_threshold": len(entries),
            "largest_call_ms": round(longest / 1000, 3), "largest_command": command,
            "evalsha_calls": stats.get("calls"), "evalsha_us_per_call": stats.get("usec_per_call")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    results: dict[str, dict[str, list[tuple[float, float]]]] = {}
    with RedisServer(appendonly=False) as server:
        apps = {"stock": make_app("stock", f"redis://{server.host}:{server.port}/0"),
                "ours": make_app("ours", f"celery-ext://{server.host}:{server.port}/0")}
        loads = {mode: workloads(app, mode) for mode, app in apps.items()}
        with server.client() as client:
            for mode in apps:  # connected, scripts loaded, queues declared
                for fn in loads[mode].values():
                    fn(50)
            for rnd in range(args.rounds):
                for name in ("group", "explicit", "single"):
                    n = args.jobs if name != "single" else args.single_jobs
                    modes = ("stock", "ours") if rnd % 2 == 0 else ("ours", "stock")
                    for mode in modes:
                        client.flushall()
                        rate, cpu = measure(loads[mode][name], n)
                        results.setdefault(name, {}).setdefault(mode, []).append((rate, cpu))
                        print(f"round {rnd + 1} {name:8} {mode:5} {rate:9.0f} jobs/s "
                              f"{cpu:6.0f} µs CPU/job", file=sys.stderr)
        largest = largest_call(server, apps["ours"], args.largest, args.slowlog_us)
        for app in apps.values():
            app.close()
    load_after = os.getloadavg()
    summary: dict[str, Any] = {}
    for name, sides in results.items():
        row = {mode: {"jobs_per_s": round(median([r for r, _ in runs])),
                      "cpu_us_per_job": round(median([c for _, c in runs]))}
               for mode, runs in sides.items()}
        row["ratio"] = round(row["ours"]["jobs_per_s"] / row["stock"]["jobs_per_s"], 2)
        summary[name] = row
    return {"settings": {"rounds": args.rounds, "jobs": args.jobs,
                         "single_jobs": args.single_jobs, "pipeline": BULK_PIPELINE_SIZE,
                         "aof": "no", "result_backend": "none", "ignore_result": True,
                         "install": True},
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in load_after],
            "summary": summary, "largest": largest}


def table(res: dict[str, Any]) -> str:
    lines = ["| workload | stock jobs/s | ours jobs/s | ours/stock | stock CPU µs/job | "
             "ours CPU µs/job |", "|---|---|---|---|---|---|"]
    labels = {"group": "group(...).apply_async()",
              "explicit": "apply_many (ours) vs loop of apply_async (stock)",
              "single": "loop of apply_async (both)"}
    for name, row in res["summary"].items():
        lines.append(f"| {labels[name]} | {row['stock']['jobs_per_s']:,} | "
                     f"{row['ours']['jobs_per_s']:,} | {row['ratio']:.2f}x | "
                     f"{row['stock']['cpu_us_per_job']} | {row['ours']['cpu_us_per_job']} |")
    big = res["largest"]
    s = res["settings"]
    lines.append("")
    lines.append(f"Largest single Redis call of one apply_many of {big['jobs']:,} jobs: "
                 f"{big['largest_call_ms']} ms, {big['largest_command']} "
                 f"({big['calls_over_threshold']} calls over "
                 f"{big['slowlog_threshold_us']} µs; EVALSHA mean {big['evalsha_us_per_call']} µs "
                 f"over {big['evalsha_calls']:,} calls; {big['seconds']} s in all).")
    lines.append(f"Settings: {s['rounds']} rounds, {s['jobs']:,} jobs per group/bulk call, "
                 f"{s['single_jobs']:,} per single-publish loop, {s['pipeline']:,} jobs per round "
                 f"trip, AOF off, no result backend, ignore_result, install(app). Load average "
                 f"before {res['load_average_before']}, after {res['load_average_after']}.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bulk", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=10_000, help="jobs per group / bulk call")
    p.add_argument("--single-jobs", type=int, default=5_000,
                   help="jobs per loop of single publishes")
    p.add_argument("--largest", type=int, default=100_000,
                   help="jobs of the bulk whose largest Redis call is measured")
    p.add_argument("--slowlog-us", type=int, default=200,
                   help="SLOWLOG records the calls slower than this (µs)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    res = run(args)
    print(table(res))
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
