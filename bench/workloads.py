"""The seven workloads. Each runs stock and ours alternately (A/B, B/A, ...) per round
on the same server and returns result rows plus details for ``results.json``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from bench import app as bench_app
from bench.harness import (
    DRAMATIQ,
    MODES,
    WORKER_FLAGS,
    Bench,
    BenchError,
    CommandCounter,
    counts_delta,
    median,
    percentile,
)
from bench.names import many_queues
from bench.report import Row


class PoolSize(NamedTuple):
    """One drain configuration: ``processes`` workers of ``-P pool -c concurrency``."""

    pool: str
    concurrency: int
    processes: int = 1

    def __str__(self) -> str:
        one = f"{self.pool} -c {self.concurrency}"
        return one if self.processes == 1 else f"{self.processes} workers x {one}"


#: The drain workload's configurations. One worker of each pool, and the threads and solo
#: pools "sized to match" Dramatiq's 2 processes x 8 threads: one worker per process
#: (prefork -c 2 is already two processes). A solo worker runs one job at a time and
#: idles while that job waits on its own round trip (two keep about 1.3 of the 2 cores
#: busy), so ``solo-x4`` also sizes the solo pool to fill the cores.
POOLS = {"prefork": PoolSize("prefork", 2), "threads": PoolSize("threads", 8),
         "solo": PoolSize("solo", 1), "threads-2x8": PoolSize("threads", 8, 2),
         "solo-x2": PoolSize("solo", 1, 2), "solo-x4": PoolSize("solo", 1, 4)}
ACKS = ("early", "late")


@dataclass(frozen=True)
class Sizes:
    """How big each workload is; ``QUICK`` is for development and the smoke test."""

    drain: int = 20_000
    enqueue: int = 20_000
    latency: int = 1_000
    latency_warmup: int = 20
    #: Latency under load: jobs drained to measure the worker's rate, then jobs sent at
    #: ``load_share`` of that rate.
    load_rate_jobs: int = 2_000
    load: int = 2_000
    load_share: float = 0.5
    many_jobs: int = 20_000
    names: tuple[int, ...] = (1, 10, 100, 1_000)
    #: many_queues' pools (``--pools`` sets these and the drain's) and sides (``--modes``).
    many_pools: tuple[str, ...] = ("prefork",)
    many_modes: tuple[str, ...] = MODES
    #: many_queues extra configurations: one job name spread over this many queues.
    one_name_queues: tuple[int, ...] = ()
    idle_seconds: float = 30.0
    idle_settle: float = 3.0
    memory_jobs: int = 100_000
    rss_jobs: int = 2_000
    fairness_fetches: int = 10_000
    weights: tuple[int, ...] = (1, 2, 3, 4)
    pools: tuple[str, ...] = ("prefork", "threads", "solo", "threads-2x8", "solo-x2", "solo-x4")
    acks: tuple[str, ...] = ACKS


FULL = Sizes()
QUICK = Sizes(drain=200, enqueue=2_000, latency=50, latency_warmup=5, load_rate_jobs=300,
              load=150, many_jobs=200,
              names=(1, 10, 100), idle_seconds=3.0, idle_settle=1.0, memory_jobs=2_000,
              rss_jobs=100, fairness_fetches=400)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def order(rnd: int, modes: tuple[str, ...] = MODES) -> tuple[str, ...]:
    """A/B in even rounds, B/A in odd ones, so drift and warm-up hit both sides."""
    return modes if rnd % 2 == 0 else tuple(reversed(modes))


def fill(bench: Bench, n: int, timeout_per_job: float = 0.02, tag: str = "",
         modes: tuple[str, ...] = MODES, **extra: Any) -> None:
    """Pre-queue ``n`` jobs with the real producer of each mode and snapshot them
    (as snapshot ``mode + tag``)."""
    for mode in modes:
        bench.flush()
        t0 = time.perf_counter()
        bench.run_client(mode, ["enqueue", "--n", str(n)], timeout=60 + n * timeout_per_job,
                         **extra)
        keys = bench.snapshot(mode + tag)
        log(f"  filled {n} jobs for {mode} in {time.perf_counter() - t0:.1f}s ({keys} keys)")


def drain_once(bench: Bench, mode: str, pool: str, concurrency: int, n: int,
               acks_late: bool, tag: str = "", processes: int = 1,
               worker: Any = None, **extra: Any) -> dict[str, Any]:
    """Restore the pre-filled queue, start the worker(s) (``worker``, if made by the
    caller), time until ``n`` jobs are done."""
    bench.restore(mode + tag)
    stats0 = bench.commandstats()
    if worker is None:
        worker = (bench.dramatiq_worker() if mode == DRAMATIQ else
                  bench.workers(mode, pool, concurrency, processes, acks_late=int(acks_late),
                                **extra))
    at_first: dict[str, Any] = {}

    def on_first(done: int) -> None:
        at_first.update(done=done, usage=worker.usage(), redis_cpu=bench.redis_cpu())

    t0 = time.perf_counter()
    worker.start()
    try:
        first, t1 = bench.wait_count(worker, n, timeout=60 + n / 50, on_first=on_first)
        usage = worker.usage()
        redis_cpu = bench.redis_cpu()
        stats1 = bench.commandstats()
    finally:
        worker.stop()
    steady_jobs = max(1, n - at_first["done"])
    return {
        "jobs_per_s": n / (t1 - t0),
        "startup_s": first - t0,
        "steady_jobs_per_s": steady_jobs / max(t1 - first, 1e-6),
        "worker_cpu_us": (usage["cpu_tree"] - at_first["usage"]["cpu_tree"]) / steady_jobs * 1e6,
        "worker_main_cpu_us": (usage["cpu_main"] - at_first["usage"]["cpu_main"])
        / steady_jobs * 1e6,
        "redis_cpu_us": (redis_cpu - at_first["redis_cpu"]) / steady_jobs * 1e6,
        "rss_main_mib": usage["rss_main"] / 2**20,
        "rss_tree_mib": usage["rss_tree"] / 2**20,
        "redis_calls_per_job": {k: round(v / n, 3) for k, v in
                                counts_delta(stats0, stats1, skip=("info", "get", "copy",
                                                                   "flushdb", "scan")).items()},
    }


#: The drain's rows of one configuration and the ``drain_once`` result each one takes: the
#: rate from the workers' start (the issue's figure), the rate from the first completion
#: on (the workers' startup left out: Celery's is about 0.5 s, Dramatiq's about 0.2 s),
#: and worker and Redis CPU per job.
DRAIN_METRICS = (("jobs/s", "jobs_per_s"), ("steady jobs/s", "steady_jobs_per_s"),
                 ("worker CPU us/job", "worker_cpu_us"), ("Redis CPU us/job", "redis_cpu_us"))


def drain_rows(config: str) -> tuple[Row, ...]:
    """The drain workload's rows of one configuration (``DRAIN_METRICS``)."""
    return tuple(Row("drain", config, metric, metric.endswith("jobs/s"),
                     primary=metric == "jobs/s") for metric, _ in DRAIN_METRICS)


def record_drain(rows: tuple[Row, ...], mode: str, res: dict[str, Any], label: str) -> None:
    """Add one drain run's figures to its rows and log them."""
    for row, (_, key) in zip(rows, DRAIN_METRICS, strict=True):
        row.add(mode, res[key])
    log(f"  {label}: {res['jobs_per_s']:.0f} jobs/s (steady {res['steady_jobs_per_s']:.0f}, "
        f"worker {res['worker_cpu_us']:.0f} us/job, redis {res['redis_cpu_us']:.0f})")


def drain(bench: Bench, sizes: Sizes, rounds: int, details: dict[str, Any]) -> list[Row]:
    """1. Drain pre-queued no-op jobs: every pool type, early and late acks."""
    n = sizes.drain
    log(f"[drain] {n} jobs")
    fill(bench, n, modes=(*MODES, DRAMATIQ))
    rows: list[Row] = []
    for pool_name in sizes.pools:
        size = POOLS[pool_name]
        for acks in sizes.acks:
            config = f"{size}, acks {acks}"
            drain_set = drain_rows(config)
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
            for rnd in range(rounds):
                for mode in order(rnd):
                    res = drain_once(bench, mode, size.pool, size.concurrency, n,
                                     acks == "late", processes=size.processes)
                    runs[mode].append(res)
                    record_drain(drain_set, mode, res, f"{config} round {rnd + 1} {mode}")
            details.setdefault("drain", {})[config] = runs
            rows += drain_set
    from bench import dramatiq_app

    config = f"dramatiq --processes {dramatiq_app.PROCESSES} --threads {dramatiq_app.THREADS}"
    drain_set = drain_rows(config)
    dram: list[dict[str, Any]] = []
    for rnd in range(rounds):
        res = drain_once(bench, DRAMATIQ, "", 0, n, True)
        dram.append(res)
        record_drain(drain_set, DRAMATIQ, res, f"{config} round {rnd + 1}")
    details.setdefault("drain", {})[config] = {DRAMATIQ: dram}
    return [*rows, *drain_set]


#: The enqueue workload's configurations: (result backend configured, ours installed).
#: Stock runs once per backend setting; its runs are the baseline of both of ours.
ENQUEUE_CONFIGS = ((False, True), (False, False), (True, True), (True, False))
#: Jobs each enqueue client sends before its measured loop (connect, load, declare).
ENQUEUE_WARMUP = 200


def enqueue_config(backend: bool, install: bool) -> str:
    return (f"1 process, result backend {'redis' if backend else 'none'}, "
            f"ours {'install(app)' if install else 'drop-in'}")


def enqueue(bench: Bench, sizes: Sizes, rounds: int, details: dict[str, Any]) -> list[Row]:
    """2. ``apply_async`` of a no-op ``ignore_result`` job from one process: stock vs ours
    with and without a result backend configured and with and without ``install(app)``;
    Dramatiq's ``send()`` from one process as the third side (same rounds)."""
    n = sizes.enqueue
    log(f"[enqueue] {n} apply_async (after {ENQUEUE_WARMUP} unmeasured)")
    rows: dict[tuple[bool, bool], tuple[Row, Row, Row]] = {}
    for backend, install in ENQUEUE_CONFIGS:
        config = enqueue_config(backend, install)
        rows[backend, install] = (Row("enqueue", config, "jobs/s", True),
                                  Row("enqueue", config, "client CPU us/job", False,
                                      primary=False),
                                  Row("enqueue", config, "Redis CPU us/job", False,
                                      primary=False))
    runs: list[dict[str, Any]] = []

    def run(mode: str, **extra: Any) -> tuple[float, float, float]:
        bench.flush()
        r0 = bench.redis_cpu()
        res = bench.run_client(mode, ["enqueue", "--n", str(n), "--warmup",
                                      str(ENQUEUE_WARMUP)], timeout=60 + n * 0.02, **extra)
        r1 = bench.redis_cpu()
        rate, cpu = res["n"] / res["seconds"], res["cpu_seconds"] / res["n"] * 1e6
        redis_us = (r1 - r0) / (res["n"] + ENQUEUE_WARMUP) * 1e6
        runs.append({"mode": mode, **extra, "jobs_per_s": rate, "cpu_us": cpu,
                     "redis_cpu_us": redis_us})
        log(f"  {mode} {extra}: {rate:.0f} jobs/s, {cpu:.0f} us CPU/job")
        return rate, cpu, redis_us

    sides: list[tuple[str, dict[str, Any]]] = [
        ("stock", {"backend": int(b), "acks_late": 1}) for b in (False, True)]
    sides += [("ours", {"backend": int(b), "install": int(i), "acks_late": 1})
              for b, i in ENQUEUE_CONFIGS]
    sides.append((DRAMATIQ, {}))
    for rnd in range(rounds):
        log(f"  round {rnd + 1}")
        for mode, extra in (sides if rnd % 2 == 0 else sides[::-1]):
            values = run(mode, **extra)
            for (backend, install), triple in rows.items():
                if mode == DRAMATIQ or (mode == "stock" and extra["backend"] == backend) or (
                        mode == "ours" and (extra["backend"], extra["install"])
                        == (backend, install)):
                    for row, value in zip(triple, values, strict=True):
                        row.add(mode, value)
    details["enqueue"] = {"jobs": n, "warmup": ENQUEUE_WARMUP, "runs": runs}
    return [row for triple in rows.values() for row in triple]


def latency(bench: Bench, sizes: Sizes, rounds: int, details: dict[str, Any]) -> list[Row]:
    """3. One job at a time to an idle prefork worker: enqueue call to job start."""
    n = sizes.latency
    log(f"[latency] {n} jobs one at a time")
    p50 = Row("latency", "prefork -c 2, idle", "p50 ms", False)
    p99 = Row("latency", "prefork -c 2, idle", "p99 ms", False)
    for rnd in range(rounds):
        for mode in order(rnd):
            bench.flush()
            worker = bench.worker(mode, "prefork", 2, latency=1)
            worker.start()
            try:
                bench.wait_ready(worker)
                time.sleep(sizes.idle_settle)
                res = bench.run_client(mode, ["latency", "--n", str(n), "--warmup",
                                              str(sizes.latency_warmup)], timeout=60 + n * 0.5,
                                       latency=1)
            finally:
                worker.stop()
            lat = res["latencies_ms"]
            p50.add(mode, percentile(lat, 50))
            p99.add(mode, percentile(lat, 99))
            log(f"  round {rnd + 1} {mode}: p50 {percentile(lat, 50):.2f} ms, "
                f"p99 {percentile(lat, 99):.2f} ms")
    return [p50, p99, *latency_under_load(bench, sizes, rounds, details)]


def start_rate(bench: Bench, worker: Any, n: int) -> float:
    """Jobs/s at which ``worker`` starts the ``n`` stamped jobs queued before it started
    (``bench.client fill-stamped``), from the first tenth's last start to the last
    start: the steady rate, without the worker's start-up."""
    deadline = time.monotonic() + 60 + n / 50
    while bench.counter.llen(bench_app.LATENCY_KEY) < n:
        if not worker.alive() or time.monotonic() > deadline:
            raise BenchError(f"stamped drain: {bench.counter.llen(bench_app.LATENCY_KEY)}/{n} "
                             f"started; log {worker.log_path}:\n{worker.log_tail()}")
        time.sleep(0.01)
    starts = sorted(float(v) for v in bench.counter.lrange(bench_app.LATENCY_KEY, 0, -1))
    bench.counter.delete(bench_app.LATENCY_KEY)
    skip = n // 10
    return (n - 1 - skip) / max(starts[-1] - starts[skip], 1e-6)


def latency_under_load(bench: Bench, sizes: Sizes, rounds: int,
                       details: dict[str, Any]) -> list[Row]:
    """3b. Enqueue-to-start latency under a steady load. Each round first measures both
    sides' drain rate (a prefork -c 2 worker, as at idle, starting stamped jobs queued
    before it started); then each side's worker is sent the same traffic, one job every
    1/rate s from one producer that never waits for a job, at ``load_share`` of stock's
    rate of that round: the same offered load, 50 % of stock's capacity."""
    pct = round(sizes.load_share * 100)
    config = f"prefork -c 2, {pct}% load"
    log(f"[latency] {sizes.load} jobs at {pct}% of stock's drain rate "
        f"(measured on {sizes.load_rate_jobs} jobs each round)")
    p50 = Row("latency", config, "p50 ms", False)
    p99 = Row("latency", config, "p99 ms", False)
    runs: list[dict[str, Any]] = []
    for rnd in range(rounds):
        drain_rate: dict[str, float] = {}
        for mode in order(rnd):
            bench.flush()
            bench.run_client(mode, ["fill-stamped", "--n", str(sizes.load_rate_jobs)],
                             timeout=60 + sizes.load_rate_jobs * 0.02, latency=1)
            worker = bench.worker(mode, "prefork", 2, latency=1)
            worker.start()
            try:
                drain_rate[mode] = start_rate(bench, worker, sizes.load_rate_jobs)
            finally:
                worker.stop()
        rate = drain_rate["stock"] * sizes.load_share
        for mode in order(rnd):
            bench.flush()
            worker = bench.worker(mode, "prefork", 2, latency=1)
            worker.start()
            try:
                bench.wait_ready(worker)
                time.sleep(sizes.idle_settle)
                res = bench.run_client(
                    mode, ["load", "--n", str(sizes.load), "--rate", f"{rate:.1f}",
                           "--warmup", str(sizes.latency_warmup)],
                    timeout=90 + sizes.load / rate, latency=1)
            finally:
                worker.stop()
            lat = res["latencies_ms"]
            p50.add(mode, percentile(lat, 50))
            p99.add(mode, percentile(lat, 99))
            runs.append({"round": rnd + 1, "mode": mode, "drain_rate": drain_rate[mode],
                         "rate": rate, "p50_ms": percentile(lat, 50),
                         "p99_ms": percentile(lat, 99)})
            log(f"  round {rnd + 1} {mode}: drain {drain_rate[mode]:.0f} jobs/s, sent "
                f"{rate:.0f}/s ({100 * rate / drain_rate[mode]:.0f}% of its rate): "
                f"p50 {percentile(lat, 50):.2f} ms, p99 {percentile(lat, 99):.2f} ms")
    details["latency_under_load"] = {"share_of_stock_rate": sizes.load_share,
                                     "jobs": sizes.load, "rate_jobs": sizes.load_rate_jobs,
                                     "runs": runs}
    return [p50, p99]


def idle(bench: Bench, sizes: Sizes, rounds: int, details: dict[str, Any]) -> list[Row]:
    """5. Commands one idle prefork pool sends (MONITOR) and causes (commandstats)."""
    secs = sizes.idle_seconds
    log(f"[idle] {secs:.0f}s per pool")
    sent = Row("idle", "prefork -c 2, empty queues", "commands sent/s", False)
    executed = Row("idle", "prefork -c 2, empty queues", "commands executed/s", False,
                   primary=False)
    out: dict[str, Any] = {}
    for rnd in range(max(1, rounds // 3)):
        for mode in order(rnd):
            bench.flush()
            worker = bench.worker(mode, "prefork", 2)
            worker.start()
            try:
                bench.wait_ready(worker)
                time.sleep(sizes.idle_settle)
                stats0 = bench.commandstats()
                with CommandCounter(bench.server) as cc:
                    time.sleep(secs)
                stats1 = bench.commandstats()
            finally:
                worker.stop()
            calls = counts_delta(stats0, stats1, skip=("info", "monitor"))
            by_client = {k: v for k, v in cc.sent.items() if k not in ("info", "monitor")}
            sent.add(mode, max(sum(by_client.values()), 0.5) / secs)
            executed.add(mode, max(sum(calls.values()), 0.5) / secs)
            out[mode] = {"sent": by_client, "executed": calls, "seconds": secs}
            log(f"  {mode}: sent {by_client}, executed {calls}")
    details["idle"] = out
    return [sent, executed]


def memory(bench: Bench, sizes: Sizes, rounds: int, details: dict[str, Any]) -> list[Row]:
    """6. Redis bytes per queued job, and worker RSS while draining them."""
    n = sizes.memory_jobs
    log(f"[memory] {n} queued jobs")
    per_job = Row("memory", f"{n:,} queued", "Redis bytes/job", False)
    rss_main = Row("memory", "prefork -c 2, draining", "worker main RSS MiB", False)
    rss_tree = Row("memory", "prefork -c 2, draining", "worker tree RSS MiB", False,
                   primary=False)
    out: dict[str, Any] = {}
    for rnd in range(max(1, rounds // 3)):
        for mode in order(rnd):
            bench.flushall()
            used0 = int(bench.info("memory")["used_memory"])
            bench.run_client(mode, ["enqueue", "--n", str(n)], timeout=60 + n * 0.02)
            used1 = int(bench.info("memory")["used_memory"])
            per_job.add(mode, (used1 - used0) / n)
            out[mode] = {"used_memory_delta_per_job": (used1 - used0) / n,
                         "memory_usage_keys_per_job": bench.key_bytes() / n}
            worker = bench.worker(mode, "prefork", 2)
            worker.start()
            try:
                bench.wait_count(worker, sizes.rss_jobs, timeout=60 + sizes.rss_jobs / 50)
                usage = worker.usage()
            finally:
                worker.stop()
            rss_main.add(mode, usage["rss_main"] / 2**20)
            rss_tree.add(mode, usage["rss_tree"] / 2**20)
            log(f"  {mode}: {(used1 - used0) / n:.0f} B/job, worker RSS main "
                f"{usage['rss_main'] / 2**20:.1f} MiB, tree {usage['rss_tree'] / 2**20:.1f} MiB")
    bench.flushall()
    details["memory"] = out
    return [per_job, rss_main, rss_tree]


def fairness(bench: Bench, sizes: Sizes, rounds: int, details: dict[str, Any]) -> list[Row]:
    """7. Share of fetches per job queue vs its weight share (ours only)."""
    f, weights = sizes.fairness_fetches, sizes.weights
    total = sum(weights)
    log(f"[fairness] {f} fetches over weights {weights}")
    # Enough jobs that no queue runs empty before f fetches (its share plus slack).
    counts = [math.ceil(f * w / total * 1.2) + 50 for w in weights]
    rows = [Row("fairness", f"weight {w}", "% of fetches", True,
                expected=100.0 * w / total) for w in weights]
    env = {"weights": ",".join(map(str, weights)), "count_limit": f}
    errors = []
    for rnd in range(rounds):
        bench.flush()
        bench.run_client("ours", ["enqueue", "--n", str(sum(counts)), "--per-task",
                                  ",".join(map(str, counts))], timeout=60 + sum(counts) * 0.02,
                         **env)
        worker = bench.worker("ours", "prefork", 2, **env)
        worker.start()
        try:
            bench.wait_count(worker, f, timeout=60 + f / 50)
        finally:
            worker.stop()
        share = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in
                 bench.counter.hgetall(bench_app.SHARE_KEY).items()}
        got = [100.0 * share.get(bench_app.job_name(i), 0) / f for i in range(len(weights))]
        for row, value in zip(rows, got, strict=True):
            row.add("ours", value)
        errors.append(max(abs(g - 100.0 * w / total) for g, w in zip(got, weights, strict=True)))
        log(f"  round {rnd + 1}: shares {[round(g, 2) for g in got]} %")
    details["fairness"] = {"weights": list(weights), "fetches": f,
                           "max_abs_error_pp": errors}
    return rows


WORKLOADS: dict[str, Callable[[Bench, Sizes, int, dict[str, Any]], list[Row]]] = {
    "drain": drain,
    "enqueue": enqueue,
    "latency": latency,
    "many_queues": many_queues,
    "idle": idle,
    "memory": memory,
    "fairness": fairness,
}


def settings(name: str, sizes: Sizes) -> str:
    """Every setting a workload runs with, in words (printed with the table and kept in
    ``results.json``): install or drop-in, acks, result backend, prefetch, pool, sizes."""
    from bench import dramatiq_app

    worker = ("Celery workers: prefetch multiplier 4 (Celery's default), no result backend, "
              "no task events, " + " ".join(WORKER_FLAGS) + "; stock = redis://, "
              "ours = celery-ext:// with install(app)")
    dram = (f"Dramatiq: RedisBroker on the same server, {dramatiq_app.PROCESSES} processes x "
            f"{dramatiq_app.THREADS} threads, prefetch {2 * dramatiq_app.THREADS} per process "
            "(its default), acks after the job, default middleware, no result backend")
    text = {
        "drain": f"{sizes.drain:,} pre-queued no-op jobs, {sizes.pools} x acks {sizes.acks}; "
                 f"{worker}; {dram}",
        "enqueue": f"{sizes.enqueue:,} apply_async of one no-op task (ignore_result=True) from "
                   f"one process after {ENQUEUE_WARMUP} unmeasured, task_acks_late=True in "
                   "the client app; result backend none or redis:// (db 1, same server); "
                   "ours with install(app) or drop-in (only the URL); no worker running; "
                   f"Dramatiq: noop.send() from one process, its default middleware, no "
                   "result backend",
        "latency": f"{sizes.latency:,} jobs one at a time after {sizes.latency_warmup} warm-up, "
                   f"prefork -c 2, acks early; under load: {sizes.load:,} jobs after "
                   f"{sizes.latency_warmup} warm-up sent to each side at {sizes.load_share:g} x "
                   f"stock's drain rate of the round (prefork -c 2 starting "
                   f"{sizes.load_rate_jobs:,} queued jobs) by one producer that does not "
                   f"wait for them; {worker}",
        "many_queues": f"{sizes.many_jobs:,} jobs over {sizes.names} job names "
                       f"(+ one name over {sizes.one_name_queues} queues), "
                       f"{[str(POOLS[p]) for p in sizes.many_pools]}, acks {sizes.acks[0]}, "
                       f"sides {sizes.many_modes}; {worker}",
        "idle": f"{sizes.idle_seconds:g} s of one idle prefork -c 2 pool, acks early; {worker}",
        "memory": f"{sizes.memory_jobs:,} queued jobs; then prefork -c 2, acks early draining "
                  f"{sizes.rss_jobs:,}; {worker}",
        "fairness": f"{sizes.fairness_fetches:,} fetches over weights {sizes.weights}, "
                    f"prefork -c 2, acks early; ours only, with install(app)",
    }
    return text[name]


def restrict(sizes: Sizes, pools: Iterable[str] | None, acks: Iterable[str] | None,
             names: Iterable[int] | None, one_name_queues: Iterable[int] | None = None,
             modes: Iterable[str] | None = None) -> Sizes:
    """Sizes limited to the given pools (the drain's and many_queues'), ack modes (the
    first is many_queues'), name counts and many_queues' sides (None = keep), plus
    many_queues' one-name-over-N-queues configurations."""
    out = sizes
    if one_name_queues:
        out = replace(out, one_name_queues=tuple(one_name_queues))
    if modes:
        out = replace(out, many_modes=tuple(modes))
    if pools:
        out = replace(out, pools=tuple(pools), many_pools=tuple(pools))
    if acks:
        out = replace(out, acks=tuple(acks))
    if names:
        out = replace(out, names=tuple(names))
    return out


def ab_drain(fills: dict[str, list[str]], jobs: int, rounds: int, pool: str,
             concurrency: int, acks_late: bool, out: Path) -> dict[str, Any]:
    """Drain cost of one feature of ours: each label's jobs are queued by its ``fills``
    command (a ``python -m ...`` argv printing ``{"seconds": ...}``), snapshotted, then
    drained by one worker, labels alternating per round. The first label is the base;
    returns rates per label, medians and the paired feature/base ratios."""
    from bench.harness import REPO_ROOT, Bench

    labels = tuple(fills)
    base, feature = labels
    with Bench.open(out / "logs") as bench:
        for label, argv in fills.items():
            bench.flush()
            done = subprocess.run(
                [sys.executable, *argv], cwd=REPO_ROOT, env=bench.env("ours"),
                stdin=subprocess.DEVNULL, capture_output=True, text=True,
                timeout=60 + jobs * 0.02, check=True)
            sent = json.loads(done.stdout)
            snap = bench.snapshot(f"ours/{label}")
            log(f"  filled {jobs} jobs ({label}) in {sent['seconds']:.1f}s ({snap} keys)")
        runs: dict[str, list[float]] = {label: [] for label in labels}
        paired: list[float] = []
        for rnd in range(rounds):
            rates: dict[str, float] = {}
            for label in order(rnd, labels):
                res = drain_once(bench, "ours", pool, concurrency, jobs, acks_late,
                                 tag=f"/{label}")
                rates[label] = res["jobs_per_s"]
                runs[label].append(res["jobs_per_s"])
                log(f"  round {rnd + 1} {label}: {res['jobs_per_s']:.0f} jobs/s (steady "
                    f"{res['steady_jobs_per_s']:.0f}, worker {res['worker_cpu_us']:.0f} us/job, "
                    f"main process {res['worker_main_cpu_us']:.0f}, "
                    f"redis {res['redis_cpu_us']:.0f} us/job, calls/job "
                    f"{res['redis_calls_per_job']})")
            paired.append(rates[feature] / rates[base])
    medians = {label: median(v) for label, v in runs.items()}
    return {
        "config": f"{pool} -c {concurrency}, acks {'late' if acks_late else 'early'}",
        "jobs": jobs, "rounds": rounds, "jobs_per_s": runs, "medians": medians,
        f"ratio_{feature}_vs_{base}": medians[feature] / medians[base],
        "paired_ratios": paired, "paired_ratio_median": median(paired),
        "loadavg": os.getloadavg(),
    }
