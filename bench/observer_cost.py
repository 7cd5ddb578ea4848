"""CPU cost of the job runtime histogram in the process that runs the jobs.

``python -m bench.observer_cost [--jobs 50000] [--queues 10] [--rounds 5]`` drives the
observer (``celery_ext.worker.observer.Observer``) the way a worker's execution slot does,
``job_started`` then ``job_finished`` per job, against a fresh server, and reports
medians over the rounds of:

- the observer's whole per-job path (start, finish, and the counter flush amortised
  over one flush per ``--flush-every`` jobs), CPU µs per job;
- the part the histogram adds per job: choosing the bucket and two in-memory
  increments (the same code, timed alone), CPU µs per job;
- the histogram's flush: the extra ``stats`` script call writing ``{ns}:runtime``
  (two fields per job queue that ran), CPU µs and wall µs per call (once a second per
  process in a worker).

CPU is this process's (``time.process_time``); the server runs in another process.
On a loaded machine the figures are provisional: compare them within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

from celery_ext.config import Settings
from celery_ext.testing.server import RedisServer
from celery_ext.worker.observer import Observer, runtime_bucket


class _Task:
    def __init__(self, name: str) -> None:
        self.name = name
        self.stall_after = None


def _observer(client: Any) -> Observer:
    obs = Observer(client, Settings(), "bench-pool")
    obs._ensure_thread = lambda: None  # type: ignore[method-assign]  # flushed by the loop
    return obs


def whole_path(client: Any, jobs: int, queues: int, flush_every: int) -> float:
    """CPU µs per job of start + finish + the amortised flush."""
    obs = _observer(client)
    tasks = [_Task(f"bench.q{i}") for i in range(queues)]
    ids = [uuid.uuid4().hex for _ in range(jobs)]
    start = time.process_time()
    for i, job_id in enumerate(ids):
        task = tasks[i % queues]
        obs.job_started(task, job_id, (i,), {})
        obs.job_finished(job_id, queue=task.name, outcome="processed")
        if (i + 1) % flush_every == 0:
            obs.flush(force_stats=True)
    obs.flush(force_stats=True)
    return (time.process_time() - start) / jobs * 1e6


def added_per_job(jobs: int, queues: int) -> float:
    """CPU µs per job of the histogram's in-memory step alone (as in job_finished)."""
    runtime: dict[str, int] = {}
    names = [f"bench.q{i}" for i in range(queues)]
    durations = [(i % 1000) / 997 for i in range(jobs)]
    start = time.process_time()
    for i, seconds in enumerate(durations):
        queue = names[i % queues]
        for name, amount in ((f"{runtime_bucket(seconds)}:{queue}", 1),
                             (f"sum_us:{queue}", int(seconds * 1e6))):
            runtime[name] = runtime.get(name, 0) + amount
    return (time.process_time() - start) / jobs * 1e6


def flush_call(client: Any, queues: int, calls: int) -> tuple[float, float]:
    """CPU and wall µs of one flush call (``HistoryWriter.flush``) carrying ``queues``
    queues' ``{ns}:runtime`` fields."""
    obs = _observer(client)
    fields: dict[str, int] = {}
    for i in range(queues):
        fields |= {f"0.01:bench.q{i}": 3, f"sum_us:bench.q{i}": 12345}
    obs.history.flush(runtime=fields)  # load the script first
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        obs.history.flush(runtime=fields)
    return ((time.process_time() - cpu) / calls * 1e6,
            (time.perf_counter() - wall) / calls * 1e6)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.observer_cost",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=50_000)
    parser.add_argument("--queues", type=int, default=10, help="distinct job queues")
    parser.add_argument("--flush-every", type=int, default=500,
                        help="jobs per counter flush (a worker flushes once a second)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    whole, added, flush_cpu, flush_wall = [], [], [], []
    with RedisServer() as server:
        client = server.client()
        for _ in range(args.rounds):
            client.flushall()
            whole.append(whole_path(client, args.jobs, args.queues, args.flush_every))
            added.append(added_per_job(args.jobs, args.queues))
            cpu, wall = flush_call(client, args.queues, 500)
            flush_cpu.append(cpu)
            flush_wall.append(wall)
    med = statistics.median
    print(f"jobs {args.jobs}, queues {args.queues}, flush every {args.flush_every} jobs, "
          f"rounds {args.rounds} (medians)")
    print(f"observer per job (start + finish + flush): {med(whole):7.2f} µs CPU")
    print(f"  of which the histogram's in-memory step: {med(added):7.2f} µs CPU")
    print(f"histogram flush call ({args.queues} queues):  {med(flush_cpu):7.1f} µs CPU, "
          f"{med(flush_wall):7.1f} µs wall; per job at {args.flush_every} jobs/flush: "
          f"{med(flush_cpu) / args.flush_every:.3f} µs CPU")


if __name__ == "__main__":
    main()
