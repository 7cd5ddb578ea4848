"""Workload 4, many_queues: the job-name curve (issue 36).

The same pre-queued jobs spread round-robin over 1, 10, 100, 1,000 or 10,000 job names,
each its own consumed queue (and, with ``--one-name-queues N``, one job name spread over
N queues: the queues' cost without Celery's per-task-name cost), drained by one worker of
each pool in ``Sizes.many_pools``. Per configuration: the drain rate from the worker's
start and from its first completion on (steady), the worker's start to its first job,
and worker and Redis CPU per job.

Every configuration runs in every round (in alternating order, and the sides alternating
inside), so our N-name figures are compared with our 1-name figures measured minutes
apart, not a quarter of an hour: on a shared machine the drift between them was as large
as the difference looked for. Besides the ratio of medians, ``results.json`` keeps each
round's own ratio (paired). ``--modes ours`` leaves stock out: with 10,000 job names its
worker's ``BRPOP`` names 10,000 keys per call (about 100 jobs/s at 1,000 names), a drain of
many minutes that says nothing new.

``names.png`` beside ``results.json`` plots the curve: each metric against the number of
job names, one line per pool (``--save-chart`` also copies it to ``bench/names.png``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.harness import Bench, median
from bench.report import Row, pyplot, save_figure

if TYPE_CHECKING:
    from bench.workloads import Sizes

#: The curve's metrics: (row metric, ``drain_once`` key, higher is better). The first is
#: the primary row (the issue's drain rate from the worker's start).
METRICS = (("jobs/s", "jobs_per_s", True), ("steady jobs/s", "steady_jobs_per_s", True),
           ("start-up s", "startup_s", False), ("Redis CPU us/job", "redis_cpu_us", False),
           ("worker CPU us/job", "worker_cpu_us", False))
#: The issue's targets against our 1-name figures of the same run: the steady rate at the
#: most names at least this share of it, and the start to the first job at most this
#: multiple of it.
STEADY_SHARE_TARGET = 0.9
STARTUP_MULTIPLE_TARGET = 2.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def many_queues(bench: Bench, sizes: Sizes, rounds: int,
                details: dict[str, Any]) -> list[Row]:
    """4. The same jobs spread over 1..10,000 job names (see the module docstring)."""
    from bench.workloads import POOLS, drain_once, fill, order

    n = sizes.many_jobs
    acks = sizes.acks[0]
    configs = [(f"{k:,} job names", f"/{k}", {"names": k}) for k in sizes.names]
    configs += [(f"1 job name over {q:,} queues", f"/1x{q}", {"queues": q})
                for q in sizes.one_name_queues]
    modes = sizes.many_modes
    rows: dict[tuple[str, str], list[Row]] = {}
    for pool_name in sizes.many_pools:
        size = POOLS[pool_name]
        for label, _, _ in configs:
            rows[pool_name, label] = [
                Row("many_queues", f"{label}, {size}, acks {acks}", metric, higher,
                    primary=metric == "jobs/s") for metric, _, higher in METRICS]
    for label, tag, extra in configs:
        log(f"[many_queues] {n} jobs over {label}")
        fill(bench, n, tag=tag, modes=modes, **extra)
    base = configs[0][0]
    paired: dict[tuple[str, str], dict[str, list[float]]] = {
        key: {m: [] for m, _, _ in METRICS} for key in rows}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {key: [] for key in rows}
    for rnd in range(rounds):
        for pool_name in sizes.many_pools:
            size = POOLS[pool_name]
            ours: dict[str, dict[str, Any]] = {}
            for label, tag, extra in (configs if rnd % 2 == 0 else configs[::-1]):
                for mode in order(rnd, modes):
                    res = drain_once(bench, mode, size.pool, size.concurrency, n,
                                     acks == "late", tag=tag, processes=size.processes,
                                     **extra)
                    for row, (_, key, _) in zip(rows[pool_name, label], METRICS, strict=True):
                        row.add(mode, res[key])
                    log(f"  {label}, {size}, round {rnd + 1} {mode}: "
                        f"{res['jobs_per_s']:.0f} jobs/s (start-up {res['startup_s']:.2f} s, "
                        f"steady {res['steady_jobs_per_s']:.0f}, Redis "
                        f"{res['redis_cpu_us']:.0f} us/job); load {os.getloadavg()[0]:.2f}")
                    if mode == "ours":
                        ours[label] = res
                        runs[pool_name, label].append(
                            {**{key: res[key] for _, key, _ in METRICS},
                             "worker_main_cpu_us": res["worker_main_cpu_us"],
                             "redis_calls_per_job": res["redis_calls_per_job"],
                             "loadavg": os.getloadavg()})
            if base in ours:
                for label, res in ours.items():
                    for metric, key, _ in METRICS:
                        paired[pool_name, label][metric].append(
                            res[key] / max(ours[base][key], 1e-9))
    bench.drop_snapshots()
    details["many_queues"] = {
        "modes": list(modes),
        "ours_vs_ours_1_name": {
            rs[0].config: {r.metric: median(r.ours) / median(rows[pool, base][i].ours)
                           for i, r in enumerate(rs) if r.ours and rows[pool, base][i].ours}
            for (pool, _), rs in rows.items()},
        # Each round's own ratio: of jobs/s at the top (as before issue 36), every metric
        # under "metrics".
        "ours_vs_ours_1_name_paired": {
            rows[key][0].config: {
                "median": median(by_metric["jobs/s"]), "rounds": by_metric["jobs/s"],
                "metrics": {m: {"median": median(v), "rounds": v}
                            for m, v in by_metric.items()}}
            for key, by_metric in paired.items() if by_metric["jobs/s"]},
        "ours_runs": {rows[key][0].config: v for key, v in runs.items()},
    }
    return [row for rs in rows.values() for row in rs]


def curve_targets(rows: list[Row]) -> list[tuple[str, float, bool]]:
    """Per pool, the most job names against 1 (ours, this run): steady rate at least
    ``STEADY_SHARE_TARGET`` of it, start to the first job within
    ``STARTUP_MULTIPLE_TARGET`` x."""
    out: list[tuple[str, float, bool]] = []
    for pool, points in _curves(rows).items():
        if len(points) < 2 or points[0][0] != 1:
            continue
        (_, first), (names, last) = points[0], points[-1]
        steady = last["steady jobs/s"] / first["steady jobs/s"]
        out.append((f"many queues {pool}: steady jobs/s at {names:,} job names >= "
                    f"{STEADY_SHARE_TARGET:g} x 1 name", steady, steady >= STEADY_SHARE_TARGET))
        start = last["start-up s"] / first["start-up s"]
        out.append((f"many queues {pool}: start-up at {names:,} job names <= "
                    f"{STARTUP_MULTIPLE_TARGET:g} x 1 name", start,
                    start <= STARTUP_MULTIPLE_TARGET))
    return out


def _curves(rows: list[Row]) -> dict[str, list[tuple[int, dict[str, float]]]]:
    """pool -> [(job names, {metric: our median})], by rising names (job-name rows only)."""
    found: dict[str, dict[int, dict[str, float]]] = {}
    for r in rows:
        head, _, pool = r.config.partition(", ")
        if r.workload != "many_queues" or not head.endswith("job names") or not r.ours:
            continue
        names = int(head.split()[0].replace(",", ""))
        found.setdefault(pool, {}).setdefault(names, {})[r.metric] = median(r.ours)
    return {pool: sorted(points.items()) for pool, points in found.items()}


def curve_chart(path: Path, rows: list[Row], title: str) -> bool:
    """The job-name curve as a PNG: steady and from-start drain rate as a share of the
    1-name rate, start to the first job, Redis CPU per job; one line per pool. False
    (nothing written) without matplotlib or without a curve in ``rows``."""
    curves = {pool: points for pool, points in _curves(rows).items() if len(points) > 1}
    if not curves:
        return False
    plt = pyplot()
    if plt is None:
        return False
    panels = (("drain rate / 1 name's", ("jobs/s", "steady jobs/s"), True),
              ("start to first job (s)", ("start-up s",), False),
              ("Redis CPU per job (µs)", ("Redis CPU us/job",), False))
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 4))
    for ax, (ylabel, metrics, relative) in zip(axes, panels, strict=True):
        for pool, points in curves.items():
            xs = [names for names, _ in points]
            for metric in metrics:
                ys = [values[metric] for _, values in points]
                if relative:
                    ys = [y / ys[0] for y in ys]
                ax.plot(xs, ys, marker="o", label=f"{pool}: {metric}" if relative else pool)
        if relative:
            ax.axhline(STEADY_SHARE_TARGET, color="grey", linestyle="--", linewidth=1)
        ax.set_ylim(bottom=0)
        ax.set_xscale("log")
        ax.set_xlabel("job names (log scale)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    save_figure(plt, fig, path, dpi=90)
    return True
