"""Drain cost of fair shares by key (ours only).

The same number of no-op jobs is queued twice with the real producer: once without a
fair key (the queue's default list), once with a per-call ``fair_key`` cycling over
``--keys`` keys (one sub-queue each; fetch rotates the ring of keys for every job and
the ack reads the key back from the record). Both are drained by one worker,
alternating A/B per round as the other workloads do; the figure is fair/plain.

    python -m bench.fair                          # 20,000 jobs, 100 keys, 3 rounds, prefork -c 2
    python -m bench.fair --jobs 5000 --rounds 1 --pool solo --acks early
    python -m bench.fair enqueue --n N [--keys K]  # (the producer step)
    python -m bench.fair fetch-cost [--jobs 20000] [--keys 100] [--rounds 5] [--batch 8]

``fetch-cost`` is ``python -m bench.script_cost --variants plain,fair``: the enqueue,
fetch and ack scripts alone (no Celery, no worker), the server's own time per job with
and without fair keys.

Prints each round, the medians and the ratios, and writes ``<out>/fair.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LABELS = ("plain", "fair")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def enqueue(n: int, keys: int) -> dict[str, float]:
    """Send ``n`` jobs of the first job name, with ``fair_key`` cycling over ``keys``
    keys (0: none), in a subprocess configured like ``bench.app``."""
    from bench import app as bench_app

    task = bench_app.TASKS[0]
    wall = time.perf_counter()
    if keys:
        for i in range(n):
            task.apply_async(fair_key=f"t{i % keys}")
    else:
        for _ in range(n):
            task.apply_async()
    return {"n": n, "seconds": time.perf_counter() - wall}


def measure(jobs: int, keys: int, rounds: int, pool: str, concurrency: int, acks_late: bool,
            out: Path) -> dict[str, Any]:
    from bench.workloads import ab_drain

    fill = ["-m", "bench.fair", "enqueue", "--n", str(jobs), "--keys"]
    return {**ab_drain({"plain": [*fill, "0"], "fair": [*fill, str(keys)]}, jobs, rounds,
                       pool, concurrency, acks_late, out), "keys": keys}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["enqueue"]:
        p = argparse.ArgumentParser(prog="python -m bench.fair enqueue")
        p.add_argument("--n", type=int, required=True)
        p.add_argument("--keys", type=int, default=0)
        ns = p.parse_args(args[1:])
        json.dump(enqueue(ns.n, ns.keys), sys.stdout)
        return 0
    if args[:1] == ["fetch-cost"]:  # the scripts alone: bench.script_cost, two variants
        from bench import script_cost

        p = argparse.ArgumentParser(prog="python -m bench.fair fetch-cost")
        p.add_argument("--jobs", type=int, default=20_000)
        p.add_argument("--rounds", type=int, default=5)
        p.add_argument("--batch", type=int, default=8)
        p.add_argument("--keys", type=int, default=100)
        ns = p.parse_args(args[1:])
        return script_cost.main(["--variants", "plain,fair", "--jobs", str(ns.jobs),
                                 "--rounds", str(ns.rounds), "--batch", str(ns.batch),
                                 "--keys", str(ns.keys)])
    p = argparse.ArgumentParser(prog="python -m bench.fair", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--keys", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pool", choices=("prefork", "threads", "solo"), default="prefork")
    p.add_argument("--concurrency", type=int, default=None,
                   help="default: 2 for prefork, 8 for threads, 1 for solo")
    p.add_argument("--acks", choices=("early", "late"), default="late")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ns = p.parse_args(args)
    conc = ns.concurrency or {"prefork": 2, "threads": 8, "solo": 1}[ns.pool]
    result = measure(ns.jobs, ns.keys, ns.rounds, ns.pool, conc, ns.acks == "late", ns.out)
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "fair.json").write_text(json.dumps(result, indent=2) + "\n")
    med = result["medians"]
    print(f"{result['config']}, {ns.jobs} jobs, {ns.keys} keys, {ns.rounds} rounds: plain "
          f"{med['plain']:.0f} jobs/s, fair {med['fair']:.0f} jobs/s; fair/plain "
          f"{result['ratio_fair_vs_plain']:.3f} (medians), {result['paired_ratio_median']:.3f} "
          f"(median of paired rounds {[round(r, 3) for r in result['paired_ratios']]}); load "
          f"{result['loadavg'][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
