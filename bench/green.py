"""``python -m bench.green``: the gevent pool, stock vs ours, and Dramatiq's gevent worker.

One worker ``celery worker -P gevent -c 200`` (``--concurrency``) drains pre-filled
queues of two jobs, stock ``redis://`` and ours (``celery-ext://`` with ``install(app)``)
alternating per round on one fresh server:

- **io**: the job waits 50 ms (``--wait``) in ``time.sleep``, cooperative under gevent's
  monkey-patching, as a job waiting on a socket does, then counts itself (one ``INCR``);
- **noop**: the job only counts itself.

A third Celery side, **stock-shared**, is stock with ``result_backend_thread_safe`` set:
under gevent Celery makes a result backend per greenlet (per job) unless that is set,
and ours sets it for the disabled and the Redis backend (``celery_ext.worker.green``),
so this side shows how much of the ratio that setting alone gives. Dramatiq's gevent
worker (``dramatiq-gevent --processes 1 --threads 200``, its own Redis broker on the same
server) drains the same io job in the same rounds. Then each side's
worker is sent the io job at a steady rate (``--load-share`` of stock's io drain rate of
that run, from one producer that never waits) and the enqueue-to-start latency of each
job is recorded (p50, p99).

Per drain: jobs/s (from the worker's start), steady jobs/s (from the first completion),
worker CPU µs per job, Redis CPU µs per job, and Redis commands per job (``INFO
commandstats``: every command the server ran, those a Lua script runs included; the job's
own ``INCR`` is one). Acks late by default (``--acks``), no
result backend, Celery's default prefetch multiplier (4). Prints a table of medians and
ratios, writes ``OUT/green.json``; logs in ``OUT/logs``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.harness import DRAMATIQ, REPO_ROOT, Bench, median, percentile
from bench.workloads import drain_once, fill, log, order

DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "green"
#: The two jobs: seconds each waits before counting itself.
JOBS = {"io": None, "noop": 0.0}
MODES = ("stock", "ours")
#: Stock with the result backend shared by the greenlets (``BENCH_SHARED_BACKEND``).
STOCK_SHARED = "stock-shared"
#: Each side: the transport (``Bench`` mode) and the app's extra settings.
SIDES: dict[str, tuple[str, dict[str, Any]]] = {
    "stock": ("stock", {}), STOCK_SHARED: ("stock", {"shared_backend": 1}),
    "ours": ("ours", {}), DRAMATIQ: (DRAMATIQ, {})}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.green", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=None, help="default 3")
    p.add_argument("--jobs", type=int, default=None, help="jobs per drain (default 10,000)")
    p.add_argument("--concurrency", type=int, default=200, help="greenlets per worker")
    p.add_argument("--wait", type=float, default=0.05, help="the io job's wait, seconds")
    p.add_argument("--acks", choices=("early", "late"), default="late")
    p.add_argument("--load-jobs", type=int, default=None,
                   help="jobs sent at a steady rate for the latency (default 3,000; 0: skip)")
    p.add_argument("--load-share", type=float, default=0.5,
                   help="the steady rate, as a share of stock's io drain rate")
    p.add_argument("--no-dramatiq", action="store_true")
    p.add_argument("--quick", action="store_true", help="1 round, 1,000 jobs, 300 at load")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def drain_side(bench: Bench, side: str, job: str, args: argparse.Namespace) -> dict[str, Any]:
    """One drain of ``job``'s pre-filled queue by ``side``'s gevent worker."""
    mode, extra = SIDES[side]
    wait = args.wait if job == "io" else 0.0
    if mode == DRAMATIQ:
        worker = bench.dramatiq_worker(processes=1, threads=args.concurrency, green=True,
                                       wait=wait)
    else:
        worker = bench.worker(mode, "gevent", args.concurrency,
                              acks_late=int(args.acks == "late"), wait=wait, **extra)
    return drain_once(bench, mode, "gevent", args.concurrency, args.jobs,
                      args.acks == "late", tag=f"/{job}", worker=worker)


def latency_side(bench: Bench, mode: str, rate: float, args: argparse.Namespace) -> list[float]:
    """Enqueue-to-start latencies (ms) of ``--load-jobs`` io jobs sent at ``rate``/s."""
    bench.flush()
    worker = bench.worker(mode, "gevent", args.concurrency, latency=1, wait=args.wait,
                          acks_late=int(args.acks == "late"))
    worker.start()
    try:
        bench.wait_ready(worker)
        time.sleep(1.0)
        res = bench.run_client(mode, ["load", "--n", str(args.load_jobs), "--rate",
                                      f"{rate:.1f}", "--warmup", "100"],
                               timeout=90 + args.load_jobs / rate, latency=1)
    finally:
        worker.stop()
    return [float(v) for v in res["latencies_ms"]]


def run(args: argparse.Namespace) -> dict[str, Any]:
    celery_sides = ("stock", STOCK_SHARED, "ours")
    sides = (*celery_sides, *(() if args.no_dramatiq else (DRAMATIQ,)))
    transports = tuple(dict.fromkeys(SIDES[side][0] for side in sides))
    out: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "settings": (f"one worker -P gevent -c {args.concurrency} (Dramatiq: dramatiq-gevent "
                     f"--processes 1 --threads {args.concurrency}); ours with install(app); "
                     f"acks {args.acks}; no result backend; prefetch multiplier 4 (Celery's "
                     f"default); io job: time.sleep({args.wait}) then INCR; noop: INCR; "
                     f"{args.jobs:,} jobs per drain, {args.rounds} rounds"),
        "loadavg_before": os.getloadavg(), "runs": [],
    }
    rates: dict[tuple[str, str], list[float]] = {}
    with Bench.open(args.out / "logs") as bench:
        for job, wait in JOBS.items():
            extra = {"wait": args.wait if wait is None else wait}
            fill(bench, args.jobs, tag=f"/{job}",
                 modes=transports if job == "io" else MODES, **extra)
        for rnd in range(args.rounds):
            for job in JOBS:
                for mode in order(rnd, sides if job == "io" else celery_sides):
                    res = drain_side(bench, mode, job, args)
                    res.update(round=rnd + 1, mode=mode, job=job)
                    out["runs"].append(res)
                    rates.setdefault((mode, job), []).append(res["steady_jobs_per_s"])
                    log(f"  round {rnd + 1} {job} {mode}: {res['jobs_per_s']:.0f} jobs/s "
                        f"(steady {res['steady_jobs_per_s']:.0f}), worker "
                        f"{res['worker_cpu_us']:.0f} us/job, calls/job "
                        f"{sum(res['redis_calls_per_job'].values()):.2f} "
                        f"{res['redis_calls_per_job']}")
        latencies: dict[str, list[float]] = {}
        if args.load_jobs:
            rate = median(rates[("stock", "io")]) * args.load_share
            out["load_rate"] = rate
            for rnd in range(args.rounds):
                for mode in order(rnd):
                    lat = latency_side(bench, mode, rate, args)
                    latencies.setdefault(mode, []).extend(lat)
                    log(f"  round {rnd + 1} latency {mode} at {rate:.0f}/s: p50 "
                        f"{percentile(lat, 50):.1f} ms, p99 {percentile(lat, 99):.1f} ms")
        out["server"] = bench.server_version()
    out["medians"] = summarize(out["runs"], sides)
    out["latency_ms"] = {m: {"p50": percentile(v, 50), "p99": percentile(v, 99)}
                         for m, v in latencies.items()}
    out["loadavg_after"] = os.getloadavg()
    return out


def summarize(runs: list[dict[str, Any]], sides: Sequence[str]) -> dict[str, Any]:
    """Median of each metric per (side, job)."""
    out: dict[str, Any] = {}
    for mode in sides:
        for job in JOBS:
            mine = [r for r in runs if r["mode"] == mode and r["job"] == job]
            if not mine:
                continue
            out[f"{mode}/{job}"] = {
                "jobs_per_s": median([r["jobs_per_s"] for r in mine]),
                "steady_jobs_per_s": median([r["steady_jobs_per_s"] for r in mine]),
                "worker_cpu_us": median([r["worker_cpu_us"] for r in mine]),
                "redis_cpu_us": median([r["redis_cpu_us"] for r in mine]),
                "redis_calls_per_job": median([sum(r["redis_calls_per_job"].values())
                                               for r in mine]),
            }
    return out


def table(res: dict[str, Any]) -> str:
    med = res["medians"]
    lines = ["| job | side | jobs/s | steady jobs/s | worker CPU us/job | Redis CPU us/job "
             "| Redis commands/job | ours / this side (steady) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for job in JOBS:
        ours = med.get(f"ours/{job}")
        for key, m in med.items():
            if not key.endswith(f"/{job}"):
                continue
            side = key.split("/")[0]
            ratio = (f"{ours['steady_jobs_per_s'] / m['steady_jobs_per_s']:.2f}x"
                     if ours and side != "ours" else "")
            lines.append(f"| {job} | {side} | {m['jobs_per_s']:.0f} | "
                         f"{m['steady_jobs_per_s']:.0f} | {m['worker_cpu_us']:.0f} | "
                         f"{m['redis_cpu_us']:.0f} | {m['redis_calls_per_job']:.2f} | {ratio} |")
    if res.get("latency_ms"):
        lines.append("")
        lines.append(f"Enqueue-to-start of the io job at {res['load_rate']:.0f} jobs/s:")
        for mode, lat in res["latency_ms"].items():
            lines.append(f"- {mode}: p50 {lat['p50']:.1f} ms, p99 {lat['p99']:.1f} ms")
    lines.append("")
    lines.append(f"Settings: {res['settings']}; server {res['server']}; load average "
                 f"before {res['loadavg_before'][0]:.2f}, after {res['loadavg_after'][0]:.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quick = args.quick
    for name, full, small in (("rounds", 3, 1), ("jobs", 10_000, 1_000),
                              ("load_jobs", 3_000, 300)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    res = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "green.json").write_text(json.dumps(res, indent=1))
    text = table(res)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
