"""Producer side of the benchmark, run as a subprocess configured like ``bench.app``.

``python -m bench.client enqueue --n N`` sends N jobs with ``apply_async`` (spread
round-robin over the app's job names, or ``--per-task`` counts) and prints
``{"n", "seconds", "cpu_seconds"}`` as JSON. ``python -m bench.client latency --n N``
sends N jobs one at a time to an idle worker, waiting for each to start, and prints
``{"latencies_ms": [...]}`` (enqueue call to job start, one clock).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence

from bench import app as bench_app


def enqueue(n: int, per_task: list[int] | None = None) -> dict[str, float]:
    """Send jobs; returns wall and CPU seconds of the ``apply_async`` loop."""
    tasks = bench_app.TASKS
    if per_task is not None:
        order = [t for t, count in zip(tasks, per_task, strict=True) for _ in range(count)]
        random.Random(0).shuffle(order)
    else:
        order = [tasks[i % len(tasks)] for i in range(n)]
    queues = bench_app.QUEUE_NAMES
    wall, cpu = time.perf_counter(), time.process_time()
    if queues:
        for i, task in enumerate(order):
            task.apply_async(queue=queues[i % len(queues)])
    else:
        for task in order:
            task.apply_async()
    return {"n": len(order), "seconds": time.perf_counter() - wall,
            "cpu_seconds": time.process_time() - cpu}


def latency(n: int, warmup: int, gap: float) -> dict[str, list[float]]:
    """Enqueue-to-start latencies in ms of ``n`` jobs after ``warmup`` unmeasured ones."""
    task = bench_app.TASKS[0]
    rec = bench_app.counter()
    rec.delete(bench_app.LATENCY_KEY)
    out: list[float] = []
    for i in range(warmup + n):
        time.sleep(gap)  # let the worker go idle again (acks, wake-up listener)
        task.apply_async(args=(time.time(),))
        reply = rec.blpop([bench_app.LATENCY_KEY], timeout=30)
        if reply is None:
            raise RuntimeError(f"job {i} did not start within 30 s")
        if i >= warmup:
            out.append(float(reply[1]) * 1000.0)
    return {"latencies_ms": out}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.client")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_enq = sub.add_parser("enqueue")
    p_enq.add_argument("--n", type=int, required=True)
    p_enq.add_argument("--per-task", default="", help="comma-separated count per job name")
    p_lat = sub.add_parser("latency")
    p_lat.add_argument("--n", type=int, required=True)
    p_lat.add_argument("--warmup", type=int, default=20)
    p_lat.add_argument("--gap", type=float, default=0.005)
    args = parser.parse_args(argv)
    if args.cmd == "enqueue":
        per = [int(c) for c in args.per_task.split(",")] if args.per_task else None
        result: object = enqueue(args.n, per)
    else:
        result = latency(args.n, args.warmup, args.gap)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
