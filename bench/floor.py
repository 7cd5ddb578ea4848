"""The drain's floor: what a Celery worker costs per job once Celery's request path is
taken out, and what any request path that keeps Celery's semantics would still cost.

``BENCH_FLOOR=1`` makes ``bench.app`` set ``Task.Strategy`` to ``strategy`` below (for
stock and ours alike). The strategy is Celery's public hook for what the worker does with
a message of a task; this one decodes the message, calls the task's function and acks,
in the event loop's thread (a thread pool's thread with ``--pool threads``). Gone:
Celery's Request, its tracer (signals, request stack, state, result handling),
revocation, ETA, expiry, time limits and retries. Kept: the transport (fetch, delivery,
prefetch credit, acks), Kombu's consumer and Message, the job's own code. It is a
measurement device, never a way to run jobs: a job that raises is acked and forgotten
here.

``BENCH_FLOOR=2`` sets ``kept_strategy``: the floor plus the least a request path must
still do per job to keep what Celery's users rely on in the simplest case (no ETA, no
expiry, no result, no events, no callbacks): the revocation check, the worker state
that ``inspect active``, ``stats`` and warm shutdown read, ``task.request`` and
``current_task``, the ``task_prerun``/``task_postrun`` signals to their receivers, the
pool's hand-off, and an ack. It leaves out the Request object's own fields, the
failure, retry and reject paths (free while the job succeeds) and everything a job
with ETA, expiry, results or events needs. So it is a lower bound on the cost of a
second, leaner implementation of Celery's request path: a rate it cannot reach, no
such implementation reaches.

``python -m bench.floor [--rounds 2] [--jobs 20000] [--processes 2] [--pool solo]``
drains the same pre-queued no-op jobs with two solo workers (Dramatiq's 2 processes)
for stock and ours, each with Celery's path and at the floor, ours also at the kept
floor, and Dramatiq, in turning order; it prints jobs/s, worker and Redis CPU per job,
and each side over Dramatiq. ``--pool threads --concurrency 8`` runs thread pools
instead.
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
#: floor 0: Celery's request path; 1: ``strategy``; 2: ``kept_strategy``.
SIDES: tuple[tuple[str, str, int], ...] = (
    ("stock", "stock", 0), ("stock at the floor", "stock", 1),
    ("ours", "ours", 0), ("ours at the floor", "ours", 1),
    ("ours, what must be kept", "ours", 2),
)


def _acker(consumer: Any) -> Callable[[Any], None]:
    """Ack as Celery's Request does: a logger and the errors that mean "connection lost"
    (logged, not raised) go to the message's ack promise."""
    ack_args = (logging.getLogger("bench.floor"), tuple(consumer.connection_errors))
    return lambda ack: ack(*ack_args)


def _ignore(result: Any) -> None:
    """The pool's completion callback: the work function has already acked."""


def _runs_inline(consumer: Any) -> bool:
    """A solo pool runs each job in the event loop's thread; others hand it off."""
    return type(consumer.pool).__module__ == "celery.concurrency.solo"


def strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., None]:
    """A task strategy that runs the job and acks, nothing else (see the module)."""
    run = task.run
    do_ack = _acker(consumer)
    inline = _runs_inline(consumer)
    submit = consumer.pool.apply_async

    def work(args: Any, kwargs_: Any, ack: Any) -> None:
        try:
            run(*args, **kwargs_)
        finally:
            do_ack(ack)

    def handle(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
               **kw: Any) -> None:
        args, kwargs_, _embed = message.decode() if body is None else body
        if inline:
            work(args, kwargs_, ack)
        else:
            submit(work, args=(args, kwargs_, ack), callback=_ignore)

    return handle


class _Running:
    """What Celery's worker state keeps of a running job: ``inspect active``, ``stats``
    and warm shutdown read these sets, which hash it by identity and hold it weakly, as
    they do Celery's Request."""

    __slots__ = ("__weakref__", "id", "name", "time_start")

    def __init__(self, task_id: str, name: str) -> None:
        self.id = task_id
        self.name = name
        self.time_start: float | None = None


def kept_strategy(task: Any, app: Any, consumer: Any,
                  **kwargs: Any) -> Callable[..., None]:
    """The floor plus what a request path keeping Celery's semantics must do (module)."""
    from celery import signals
    from celery._state import _task_stack
    from celery.app.task import Context
    from celery.states import FAILURE, SUCCESS
    from celery.worker import state as worker_state

    run, name, hostname = task.run, task.name, consumer.hostname
    do_ack = _acker(consumer)
    submit = consumer.pool.apply_async
    revoked = worker_state.revoked
    reserved, accepted, ready = (worker_state.task_reserved, worker_state.task_accepted,
                                 worker_state.task_ready)
    push_task, pop_task = _task_stack.push, _task_stack.pop
    # The tracer's own calls: the request stack takes a ready Context.
    push_request, pop_request = task.request_stack.push, task.request_stack.pop
    prerun, postrun = signals.task_prerun, signals.task_postrun

    def work(running: _Running, context: Context, args: Any, kwargs_: Any,
             ack: Any) -> None:
        accepted(running)
        push_task(task)
        push_request(context)
        task_id = running.id
        state, retval = FAILURE, None
        try:
            if prerun.receivers:
                prerun.send(sender=task, task_id=task_id, task=task, args=args,
                            kwargs=kwargs_)
            retval = run(*args, **kwargs_)
            state = SUCCESS
        finally:
            try:
                if postrun.receivers:
                    postrun.send(sender=task, task_id=task_id, task=task, args=args,
                                 kwargs=kwargs_, retval=retval, state=state)
            finally:
                pop_task()
                pop_request()
                ready(running, successful=state == SUCCESS)
                do_ack(ack)

    def handle(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
               **kw: Any) -> None:
        headers = message.headers
        task_id = headers["id"]
        if task_id in revoked:
            do_ack(ack)
            return
        args, kwargs_, embed = message.decode() if body is None else body
        context = Context(headers, args=args, kwargs=kwargs_, called_directly=False,
                          delivery_info=message.delivery_info, hostname=hostname, **embed)
        running = _Running(task_id, name)
        reserved(running)
        submit(work, args=(running, context, args, kwargs_, ack), callback=_ignore)

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
                   help="workers per Celery side (default 2, Dramatiq's processes)")
    p.add_argument("--pool", choices=("solo", "threads"), default="solo")
    p.add_argument("--concurrency", type=int, default=1,
                   help="threads per worker with --pool threads (Dramatiq's: 8)")
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
                res = drain_once(bench, mode, args.pool, args.concurrency, args.jobs, late,
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
    print(f"drain of {args.jobs:,} no-op jobs, acks {args.acks}, {args.processes} "
          f"worker(s) x {args.pool} -c {args.concurrency} (Dramatiq: 2 processes x 8 "
          f"threads), median of {args.rounds} rounds")
    print(f"{'side':<24} {'jobs/s':>8} {'steady':>8} {'worker us/job':>14} "
          f"{'Redis us/job':>13} {'x Dramatiq':>11}")
    for label, m in med.items():
        print(f"{label:<24} {m['jobs_per_s']:8.0f} {m['steady_jobs_per_s']:8.0f} "
              f"{m['worker_cpu_us']:14.0f} {m['redis_cpu_us']:13.0f} "
              f"{m['jobs_per_s'] / dram:11.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"jobs": args.jobs, "rounds": args.rounds, "acks": args.acks,
         "processes": args.processes, "pool": args.pool,
         "concurrency": args.concurrency, "runs": runs,
         "medians": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
