"""The requeuer: moves due jobs from the scheduled and retry sets to their job queues.

Every worker pool runs one (``start()``/``stop()`` around the one-shot
``promote()``). Each promote call is one script that moves the due jobs found by
the previous call and reports the next ones; ZREM inside the script decides who
moves a job, so with many pools promoting at once each job is promoted exactly
once. Promoted jobs wake idle pools like a fresh enqueue.

Timing without polling, and without a herd:

* One requeuer, the *leader* (holder of the ``{ns}:requeuer`` lease, renewed by
  its passes), sleeps until the next due time (read from Redis, so host clocks do
  not matter), but at least ``promote_min_interval`` (jobs falling due together
  are promoted in one pass) and at most ``promote_interval``.
* The others make one pass per ``promote_interval``: they promote whatever is
  due if the leader is gone, and take the lease once it expires
  (``promote_interval + 1 s`` after the leader's last pass; if leadership moves
  while the leader is merely slow, both promote for a while, still exactly once).
* A producer that schedules a job earlier than every other publishes
  ``{ns}:schedule``; every requeuer wakes for it, as for a leader that stops and
  hands over. An idle pool thus sends one command per ``promote_interval``.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from kombu.utils.encoding import bytes_to_str

from celery_ext.config import Settings
from celery_ext.options.priority import level
from celery_ext.store.copies import copies, queue_of, run_scripts, set_counts
from celery_ext.store.history import HistoryWriter, sample_queues
from celery_ext.store.job_index import index_keys, index_ttl_ms
from celery_ext.store.keys import Keys
from celery_ext.store.queue_sizes import QueueSizes
from celery_ext.store.scripts import Scripts
from celery_ext.worker.background import BackgroundLoop

logger = logging.getLogger("celery_ext.worker.requeuer")

#: Published on the schedule channel by a leader that stops (followers take over).
HANDOVER = "handover"


@dataclass
class PromoteResult:
    """What one ``promote()`` did."""

    moved: int = 0
    #: Seconds until the earliest job not yet due; None when both sets are empty.
    next_due_in: float | None = None
    #: Whether this requeuer holds the lease (wakes for every due time).
    leader: bool = False
    calls: int = 0


class Requeuer(BackgroundLoop):
    """Promotes due scheduled jobs and retries of one namespace."""

    thread_name = "celery_ext-requeuer"

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self.keys = Keys.for_settings(settings)
        self.scripts = Scripts(client)
        self.id = uuid.uuid4().hex
        self.lease_ms = int((settings.promote_interval + 1) * 1000)
        self.leader = False
        BackgroundLoop.__init__(self)
        self._failing = False
        self.passes = 0
        self.promoted = 0
        self.history = HistoryWriter(client, settings)
        self._sampled_at: float | None = None

    # -- one pass ------------------------------------------------------------------------
    def promote(self) -> PromoteResult:
        """Move every job that is due now (in batches of ``promote_batch``).

        On a cluster the home copy's call takes the lease (its sets are empty there);
        the leader then promotes every known job queue's copy, the calls of one round
        pipelined by master, and the home ready hint gets the queues that got jobs."""
        result = PromoteResult()
        self._promote_in([self.keys], result)
        if self.keys.cluster and result.leader:
            self._promote_in(copies(self.client, self.keys)[1:], result)
        self.leader = result.leader
        self.passes += 1
        self.promoted += result.moved
        return result

    def _promote_in(self, parts: list[Keys], result: PromoteResult) -> None:
        """Call ``promote.lua`` on each copy of ``parts`` until none has due candidates
        left; ``result`` gets the moves, the earliest next due time over the copies and
        (from the home copy) the lease."""
        candidates: dict[Keys, list[tuple[str, str, str, int]]] = {k: [] for k in parts}
        active, ready = list(parts), set()
        while active:
            calls = [self._promote_call(k, candidates[k]) for k in active]
            replies = run_scripts(self.client, self.scripts, calls)
            result.calls += len(calls)
            again = []
            for k, (moved, found, next_due, leader) in zip(active, replies, strict=True):
                result.moved += int(moved)
                if k.is_home:
                    result.leader = bool(leader)
                elif int(moved):
                    ready.add(queue_of(k))
                flat = [bytes_to_str(v) for v in found]
                stuck = not int(moved) and candidates[k]
                previous = candidates[k]
                candidates[k] = [(flat[i], flat[i + 1], flat[i + 2], int(flat[i + 3]))
                                 for i in range(0, len(flat), 4)]
                if not candidates[k]:
                    due = None if int(next_due) < 0 else int(next_due) / 1000
                    result.next_due_in = _earliest(result.next_due_in, due)
                elif stuck and candidates[k] == previous:
                    # Not movable (a record changed under us?): leave them to the next pass.
                    result.next_due_in = _earliest(result.next_due_in,
                                                   self.settings.promote_min_interval)
                else:
                    again.append(k)
            active = again
        if ready:
            self.client.sadd(self.keys.home.ready, *sorted(ready))

    def _promote_call(self, k: Keys, candidates: list[tuple[str, str, str, int]]
                      ) -> tuple[str, list[str], list[Any]]:
        """One ``promote.lua`` call on the copy ``k``: move ``candidates`` (found by the
        previous call), report the next."""
        steps = self.settings.priority_steps
        return ("promote",
                [k.scheduled, k.retry, k.scheduled_jobs, k.ready, k.queues, k.requeuer_lease,
                 *index_keys(k),
                 *(k.queue_level(q, level(p, steps)) for _, _, q, p in candidates)],
                [k.wake_channel, k.queue(""), self.settings.promote_batch, self.id,
                 self.lease_ms, index_ttl_ms(self.settings),
                 *(v for which, job_id, _, _ in candidates for v in (which, job_id))])

    def sample_history(self) -> None:
        """Store a queue-size sample in the history (the leader does, every
        ``history_sample_interval``, so the plots have it with no dashboard running)."""
        scheduled, retry, dead = set_counts(self.client, self.keys)
        self._sampled_at = time.monotonic()
        self.history.gauge(sample_queues(QueueSizes(self.client, self.settings, self.scripts), {
            "scheduled": int(scheduled), "retry": int(retry), "dead": int(dead)}))

    def release(self) -> None:
        """Give up the lease (if held) and let the other requeuers know."""
        if not self.leader:
            return
        self.leader = False
        self.client.eval(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]); "
            "redis.call('PUBLISH', ARGV[2], ARGV[3]) end return 0",
            1, self.keys.requeuer_lease, self.id, self.keys.schedule_channel, HANDOVER)

    # -- loop ----------------------------------------------------------------------------
    def _subscribe(self) -> Any:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(self.keys.schedule_channel)
        return pubsub

    def _run(self) -> None:
        cap = self.settings.promote_interval
        pubsub: Any = None
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    # Subscribe before the pass: a job scheduled meanwhile still wakes us.
                    pubsub = self._subscribe()
                result = self.promote()
                if result.leader and (self._sampled_at is None or time.monotonic()
                                      - self._sampled_at >= self.settings.history_sample_interval):
                    try:
                        self.sample_history()
                    except redis.RedisError:
                        raise
                    except Exception:  # a plot must never stop the promotion of jobs
                        logger.exception("celery_ext: could not sample queue sizes")
                if self._failing:
                    logger.info("celery_ext: requeuer reached Redis again")
                    self._failing = False
                wait = cap
                if result.leader:
                    wait = min(wait, self.settings.history_sample_interval)
                if result.leader and result.next_due_in is not None:
                    wait = min(result.next_due_in, wait)
                wait = max(wait, self.settings.promote_min_interval)
                self._sleep(pubsub, wait)
            except redis.RedisError as exc:
                if not self._failing:
                    logger.error("celery_ext: requeuer cannot promote due jobs: %s "
                                 "(will retry)", exc)
                    self._failing = True
                if pubsub is not None:
                    self._close_listener(pubsub, "schedule")
                    pubsub = None
                self._stop.wait(min(cap, 0.5 + random.random()))
        if pubsub is not None:
            pubsub.close()

    def _sleep(self, pubsub: Any, seconds: float) -> None:
        """Wait ``seconds``, or until a job is scheduled earlier or the leader hands
        over (pub/sub), or stop()."""
        self._wait_for_message(pubsub, seconds)

    def stop(self) -> None:
        self.stop_loop()
        try:
            self.release()
        except redis.RedisError as exc:
            logger.warning("celery_ext: requeuer could not hand over its lease: %s", exc)


def _earliest(a: float | None, b: float | None) -> float | None:
    """The sooner of two waits (None: nothing due)."""
    return b if a is None else a if b is None else min(a, b)
