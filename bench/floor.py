"""The drain's floor: what a Celery worker costs per job once Celery's request path is
taken out, and where the rest of the gap to Dramatiq lies.

``BENCH_FLOOR=1`` makes ``bench.app`` set ``Task.Strategy`` to ``strategy`` below (for
stock and ours alike). The strategy is Celery's public hook for what the worker does with
a message of a task; this one decodes the message, calls the task's function and acks,
in the event loop's thread. Gone: Celery's Request, its pool hand-off, its tracer
(signals, request stack, state, result handling), revocation, ETA, expiry, time limits
and retries. Kept: the transport (fetch, delivery, prefetch credit, acks), Kombu's
consumer and Message, the job's own code. It is a measurement device, never a way to run
jobs: a job that raises is acked and forgotten here.

``python -m bench.floor [--rounds 2] [--jobs 20000] [--processes 2]`` drains the same
pre-queued no-op jobs with two solo workers (Dramatiq's 2 processes) for stock and ours,
each with Celery's path and at the floor, and Dramatiq, in turning order; it prints jobs/s, worker
and Redis CPU per job, and each side over Dramatiq.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.harness import DRAMATIQ, REPO_ROOT, Bench, median
from bench.workloads import drain_once, fill, log

OUT = REPO_ROOT / "bench" / "results" / "floor"
#: (label, mode, floor) of each Celery side; Dramatiq runs after them in each round.
SIDES: tuple[tuple[str, str, int], ...] = (
    ("stock", "stock", 0), ("stock at the floor", "stock", 1),
    ("ours", "ours", 0), ("ours at the floor", "ours", 1),
)


def strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., None]:
    """A task strategy that runs the job in place and acks (see the module)."""
    run = task.run
    # The ack promise takes what Celery's Request passes it: a logger and the errors
    # that mean "connection lost" (logged, not raised).
    ack_args = (logging.getLogger("bench.floor"), tuple(consumer.connection_errors))

    def handle(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
               **kw: Any) -> None:
        args, kwargs_, _embed = message.decode() if body is None else body
        try:
            run(*args, **kwargs_)
        finally:
            ack(*ack_args)

    return handle


def _log_run(rnd: int, label: str, res: dict[str, Any]) -> None:
    log(f"  round {rnd + 1} {label}: {res['jobs_per_s']:.0f} jobs/s (steady "
        f"{res['steady_jobs_per_s']:.0f}), worker {res['worker_cpu_us']:.0f} us/job, "
        f"redis {res['redis_cpu_us']:.0f}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--acks", choices=("early", "late"), default="late")
    p.add_argument("--processes", type=int, default=2,
                   help="solo workers per Celery side (default 2, Dramatiq's processes)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    late = args.acks == "late"
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in SIDES}
    runs["dramatiq"] = []
    with Bench.open(args.out / "logs") as bench:
        fill(bench, args.jobs, modes=("stock", "ours", DRAMATIQ))
        for rnd in range(args.rounds):
            sides = SIDES if rnd % 2 == 0 else tuple(reversed(SIDES))
            for label, mode, floor in sides:
                res = drain_once(bench, mode, "solo", 1, args.jobs, late,
                                 processes=args.processes, floor=floor)
                runs[label].append(res)
                _log_run(rnd, label, res)
            res = drain_once(bench, DRAMATIQ, "", 0, args.jobs, True)
            runs["dramatiq"].append(res)
            _log_run(rnd, "dramatiq", res)
    med = {label: {k: median([r[k] for r in rs]) for k in
                   ("jobs_per_s", "steady_jobs_per_s", "worker_cpu_us", "redis_cpu_us")}
           for label, rs in runs.items()}
    dram = med["dramatiq"]["jobs_per_s"]
    print(f"drain of {args.jobs:,} no-op jobs, acks {args.acks}, {args.processes} solo "
          f"worker(s) (Dramatiq: 2 processes x 8 threads), median of {args.rounds} rounds")
    print(f"{'side':<20} {'jobs/s':>8} {'steady':>8} {'worker us/job':>14} "
          f"{'Redis us/job':>13} {'x Dramatiq':>11}")
    for label, m in med.items():
        print(f"{label:<20} {m['jobs_per_s']:8.0f} {m['steady_jobs_per_s']:8.0f} "
              f"{m['worker_cpu_us']:14.0f} {m['redis_cpu_us']:13.0f} "
              f"{m['jobs_per_s'] / dram:11.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"jobs": args.jobs, "rounds": args.rounds, "acks": args.acks,
         "processes": args.processes, "runs": runs,
         "medians": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
