"""Drain cost of per-message priority (ours only).

The same number of no-op jobs is queued twice with the real producer: once every job
at the default priority (one list per job queue is used), once spread evenly over the
four default levels (priority 0, 3, 6, 9 in turn: four lists, and fetch finds the
lower levels empty before each job of a higher one). Both are drained by one worker,
alternating A/B per round as the other workloads do; the figure is spread/default.

    python -m bench.priority                       # 20,000 jobs, 3 rounds, prefork -c 2, acks late
    python -m bench.priority --jobs 5000 --rounds 1 --pool solo --acks early
    python -m bench.priority enqueue --n N [--priorities 0,3,6,9]   # (the producer step)
    python -m bench.priority fetch-cost [--jobs 20000] [--rounds 5] [--batch 8]

``fetch-cost`` is ``python -m bench.script_cost --variants plain,priority``: the
enqueue, fetch and ack scripts alone (no Celery, no worker), the server's own time per
job with and without priorities.

Prints each round, the medians and the ratios, and writes ``<out>/priority.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: The two configurations: label -> priorities the producer cycles through ("" = none given).
CONFIGS = {"default": "", "spread": "0,3,6,9"}
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def enqueue(n: int, priorities: list[int]) -> dict[str, float]:
    """Send ``n`` jobs of the first job name, cycling through ``priorities`` (run in a
    subprocess configured like ``bench.app``, as ``bench.client`` is)."""
    from bench import app as bench_app

    task = bench_app.TASKS[0]
    wall = time.perf_counter()
    if priorities:
        for i in range(n):
            task.apply_async(priority=priorities[i % len(priorities)])
    else:
        for _ in range(n):
            task.apply_async()
    return {"n": n, "seconds": time.perf_counter() - wall}


def measure(jobs: int, rounds: int, pool: str, concurrency: int, acks_late: bool,
            out: Path) -> dict[str, Any]:
    from bench.workloads import ab_drain

    fill = ["-m", "bench.priority", "enqueue", "--n", str(jobs), "--priorities"]
    return ab_drain({label: [*fill, prios] for label, prios in CONFIGS.items()}, jobs,
                    rounds, pool, concurrency, acks_late, out)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["enqueue"]:
        p = argparse.ArgumentParser(prog="python -m bench.priority enqueue")
        p.add_argument("--n", type=int, required=True)
        p.add_argument("--priorities", default="")
        ns = p.parse_args(args[1:])
        prios = [int(x) for x in ns.priorities.split(",") if x]
        json.dump(enqueue(ns.n, prios), sys.stdout)
        return 0
    if args[:1] == ["fetch-cost"]:  # the scripts alone: bench.script_cost, two variants
        from bench import script_cost

        p = argparse.ArgumentParser(prog="python -m bench.priority fetch-cost")
        p.add_argument("--jobs", type=int, default=20_000)
        p.add_argument("--rounds", type=int, default=5)
        p.add_argument("--batch", type=int, default=8)
        ns = p.parse_args(args[1:])
        return script_cost.main(["--variants", "plain,priority", "--jobs", str(ns.jobs),
                                 "--rounds", str(ns.rounds), "--batch", str(ns.batch)])
    p = argparse.ArgumentParser(prog="python -m bench.priority", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pool", choices=("prefork", "threads", "solo"), default="prefork")
    p.add_argument("--concurrency", type=int, default=None,
                   help="default: 2 for prefork, 8 for threads, 1 for solo")
    p.add_argument("--acks", choices=("early", "late"), default="late")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ns = p.parse_args(args)
    conc = ns.concurrency or {"prefork": 2, "threads": 8, "solo": 1}[ns.pool]
    result = measure(ns.jobs, ns.rounds, ns.pool, conc, ns.acks == "late", ns.out)
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "priority.json").write_text(json.dumps(result, indent=2) + "\n")
    med = result["medians"]
    print(f"{result['config']}, {ns.jobs} jobs, {ns.rounds} rounds: default "
          f"{med['default']:.0f} jobs/s, spread over 4 levels {med['spread']:.0f} jobs/s; "
          f"spread/default {result['ratio_spread_vs_default']:.3f} (medians), "
          f"{result['paired_ratio_median']:.3f} (median of paired rounds "
          f"{[round(r, 3) for r in result['paired_ratios']]}); load "
          f"{result['loadavg'][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
