"""One run of a periodic job entry, as the producer writes it.

The periodic leader (``worker/periodic_leader.py``) publishes each run through Celery
(celery.beat's own ``Scheduler.apply_async``: the entry's args, kwargs and options) with
a deterministic job id per (namespace, entry, due time) and a :class:`PeriodicRun` in a
context variable; the producer (``producer.publish.Enqueuer``) sees it and writes the
job with ``periodic_run.lua`` (one node: the entry's check and the push are one script)
or :func:`write_run_apart` (a cluster, where the entry and the job queue are in
different slots, and a run with a countdown or eta, which goes to the scheduled set)
instead of a plain enqueue.

A run carries the headers :data:`HEADER` (entry name) and :data:`DUE_HEADER`; the
process that runs it records its outcome on the entry (:data:`OUTCOMES`).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import redis
from celery.beat import ScheduleEntry, Scheduler
from kombu.exceptions import OperationalError
from kombu.utils.encoding import bytes_to_str

from celery_ext.store.keys import Keys

#: Message header naming the entry a run belongs to.
HEADER = "celery_ext_periodic"
#: Message header holding the run's due time (ms, Redis clock); absent on a run-now.
DUE_HEADER = "celery_ext_due"
#: How long (ms) a job queue's copy remembers the latest due time of an entry pushed
#: into it (cluster; refreshed by each run): a leader stalled between its check of the
#: entry and its push for longer than this could push that due time again.
RUN_RECORD_TTL_MS = 7 * 24 * 3600 * 1000
#: A run's Celery end state -> the outcome recorded on its entry.
OUTCOMES = {"SUCCESS": "success", "FAILURE": "failure", "RETRY": "retry"}


@dataclass
class PeriodicRun:
    """One run of an entry being published; ``outcome`` is set by the producer."""

    entry: str
    job_id: str
    #: The due time the run was planned from (``next_due`` must still say it); None
    #: for a run-now outside the schedule.
    expected_ms: int | None
    due_ms: int
    #: ``next_due`` after this run (None: unchanged, a run-now).
    next_ms: int | None
    #: Due times this run stands for without their own run (missed, ``once``).
    passed: int = 0
    #: The entry's spec (task, schedule, time zone) the run was planned under: the run is
    #: written only while the entry's state still has it, so a run planned before the
    #: schedule changed (or the entry was removed) is not. "" for a run-now.
    spec: str = ""
    #: The script's answer: 1 pushed, 2 pushed before (same job id), 0 another leader
    #: took this due time, -1 paused, -2 moved on without a run as asked.
    outcome: int | None = None

    def script_args(self) -> list[Any]:
        """ARGV[1..6] of ``periodic_run.lua``."""
        return ["" if self.expected_ms is None else self.expected_ms, self.due_ms,
                "" if self.next_ms is None else self.next_ms, self.passed, self.job_id,
                self.spec]


_current: ContextVar[PeriodicRun | None] = ContextVar("celery_ext_periodic", default=None)


def current_run() -> PeriodicRun | None:
    """The run being published in this context (read by ``producer.Enqueuer.put``)."""
    return _current.get()


@contextmanager
def publishing(run: PeriodicRun) -> Iterator[PeriodicRun]:
    token = _current.set(run)
    try:
        yield run
    finally:
        _current.reset(token)


def run_id(namespace: str, name: str, due_ms: int) -> str:
    """The job id of an entry's run for one due time: the same in every pool."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"celery-ext:{namespace}:periodic:{name}:{due_ms}"))



class PeriodicError(Exception):
    """A run could not be published for a reason retrying will not fix (logged, skipped)."""


def publish_run(scheduler: Scheduler, entry: ScheduleEntry, run: PeriodicRun) -> int:
    """Publish one run through celery.beat's ``Scheduler.apply_async`` (the entry's
    args, kwargs, options) with the run's job id and headers. Returns the producer's
    outcome. Connection errors propagate (the run is retried: same job id);
    anything else raises :class:`PeriodicError`."""
    one = copy.copy(entry)
    headers = {**dict((entry.options or {}).get("headers") or {}), HEADER: run.entry}
    if run.expected_ms is not None:
        headers[DUE_HEADER] = run.due_ms
    one.options = {**(entry.options or {}), "task_id": run.job_id, "headers": headers}
    with publishing(run):
        try:
            scheduler.apply_async(one, advance=False)
        except Exception as exc:
            cause = exc.__cause__ or exc.__context__ or exc
            if isinstance(cause, OperationalError | redis.ConnectionError | redis.TimeoutError):
                raise redis.ConnectionError(str(cause)) from exc
            raise PeriodicError(str(exc)) from exc
    if run.outcome is None:
        raise PeriodicError("the publish did not reach the celery-ext transport "
                            "(task_always_eager, or routed to another broker?)")
    return run.outcome


def run_marker(run: PeriodicRun) -> str:
    """The publish marker of a run on a cluster: one per (entry, due time), as its job id."""
    return f"periodic:{run.job_id}"


def write_run_apart(call: Callable[[str, list[str], list[Any]], Any], client: Any,
                    keys: Keys, queue: str, push: tuple[str, list[str], list[Any]],
                    run: PeriodicRun) -> int:
    """A run of a periodic job written in two steps, where one script cannot check the
    entry and write the job: on a cluster, where the entry (home copy) and the job queue
    (its own copy) are in different slots, and for a run with a countdown or eta on any
    topology, which goes to the scheduled set of the queue's copy (``periodic_run.lua``
    pushes to a job queue only). First the run is written in the queue's copy, where
    ``enqueue.lua`` or ``schedule.lua`` writes it only if the copy's run record of the
    entry (``periodic_pushed``, the latest due time written) is older, and records it in
    the same call; then ``periodic_run.lua`` on the home copy records the run and moves
    ``next_due`` on only if it still holds the due time. A leader that dies in between
    leaves the due time to the next leader, and a leader stalled between its check and
    its write finds the due time taken: the record makes either write a no-op, whatever
    the publish marker's life (``publish_idempotency_ttl``, 0 = off): still exactly once.

    ``push``: (script, KEYS, ARGV) of the write in the queue's copy, ``enqueue`` or
    ``schedule``, whose last key is the run's publish marker (:func:`run_marker`) and
    last value its TTL; the run record's key and values are added after them.
    ``call(script, keys, args)`` runs one script (the producer's, which waits for
    ``wait_replicas``). Returns the outcome as ``periodic_run.lua`` gives it.
    """
    copy, home = keys.of(queue), keys.home
    if run.expected_ms is not None:
        state = client.hmget(home.periodic_entry(run.entry), "next_due", "paused", "spec")
        if bytes_to_str(state[0] or b"") != str(run.expected_ms) or (
                run.spec and bytes_to_str(state[2] or b"") != run.spec):
            return 0  # another leader took this due time, or the schedule changed
        if state[1] == b"1":  # paused: the due time passes without a run
            return int(call("periodic_run", [home.periodic_entry(run.entry)],
                            [*run.script_args(), "", "", "", 0, ""]))
    record_keys, record_args = ([copy.periodic_pushed(run.entry)],
                                [run.due_ms, RUN_RECORD_TTL_MS]) if run.expected_ms is not None \
        else ([], [])
    script, push_keys, push_args = push
    reply = call(script, [*push_keys, *record_keys], [*push_args, *record_args])
    # enqueue: the list's length, or -1 when nothing was pushed; schedule: {1 or 0, ...}
    pushed = int(reply[0] if isinstance(reply, list) else reply)
    if pushed > 0 and keys.cluster:  # the home hints beside the copy's
        client.sadd(home.queues, queue)
        if script == "enqueue" and pushed == 1:
            client.sadd(home.ready, queue)
    return int(call("periodic_run", [home.periodic_entry(run.entry)],
                    [*run.script_args(), "", "", "", 0, "", 0, "1"]))
