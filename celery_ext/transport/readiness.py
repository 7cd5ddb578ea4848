"""Which of a channel's job queues are worth fetching from (pure bookkeeping, no I/O).

A pool does not poll empty queues. A queue is *active* while it may hold jobs: a
fetch that finds it empty (or paused, or at its max_concurrency) deactivates it; a
wake-up published by a producer, the ready set read once per idle refresh, or a lost
connection (anything may have happened meanwhile) activates it again. The channel
does the I/O and reports what it saw; this decides.

The one subtle rule, the lost wake-up: Redis may run a fetch, find a queue empty,
then run a push whose wake-up the channel reads *before* the fetch's reply. That
reply's "empty" is older than the wake-up and must not deactivate the queue again,
or nothing would wake it before the next ready refresh. So wake-ups read while a
fetch is on the wire are remembered and win over its reply; a (re)subscription
confirmed meanwhile (notifications may have been missed) makes the reply's caller
re-read the ready set instead.

A rate-limited queue whose next job is not due yet is blocked too, with a wait: it
stays inactive until then (:meth:`ReadyQueues.throttle`, :meth:`ReadyQueues.release_due`;
the channel sets a timer for :meth:`ReadyQueues.next_due`). The idle refresh does not
wake it early (the ready set says it holds jobs, not that they are due); a wake-up does,
which costs one fetch that is refused again with a new wait.
"""

from __future__ import annotations

from collections.abc import Iterable

from celery_ext.transport.round_robin import WeightedRoundRobin


class ReadyQueues:
    """The active job queues of one channel and the weighted round-robin over them."""

    def __init__(self, default_weight: int) -> None:
        self.sched = WeightedRoundRobin(default_weight=default_weight)
        self._fetching = False
        self._woken_in_fetch: set[str] = set()
        self._resubscribed_in_fetch = False
        #: Rate-limited queues -> monotonic time their next job is due.
        self._throttled: dict[str, float] = {}

    # -- what the channel consumes -----------------------------------------------------
    def add(self, queue: str, weight: int) -> None:
        self.sched.add_queues({queue: weight})

    def remove(self, queue: str) -> None:
        self.sched.remove_queues([queue])
        self._throttled.pop(queue, None)

    # -- fetching ------------------------------------------------------------------------
    def has_active(self) -> bool:
        return self.sched.has_active()

    def all_active(self) -> bool:
        return self.sched.all_active()

    def take(self, n: int) -> list[str]:
        """Up to ``n`` picks for one fetch, by weight among the active queues."""
        return self.sched.take(n)

    def fetch_sent(self) -> None:
        self._fetching = True
        if self._woken_in_fetch:  # (only wake-ups during this fetch count)
            self._woken_in_fetch.clear()
        self._resubscribed_in_fetch = False

    def fetch_replied(self, not_fetchable: Iterable[str]) -> bool:
        """The fetch's reply names queues found empty or blocked: deactivate them,
        except those woken while it was on the wire. Returns True when the caller must
        re-read the ready set (a subscription was confirmed meanwhile)."""
        self._fetching = False
        woken = self._woken_in_fetch
        for name in not_fetchable:
            if name not in woken:
                self.sched.deactivate(name)
        reread = self._resubscribed_in_fetch
        self._resubscribed_in_fetch = False
        return reread

    def fetch_lost(self) -> None:
        """The fetch's connection failed: anything may have happened; try every queue."""
        self._fetching = False
        self.activate_all()

    # -- what says a queue may hold jobs --------------------------------------------------
    def woken(self, names: list[str], refresh: bool = False) -> None:
        """A wake-up, or the ready set (``refresh``), says these queues hold jobs."""
        if refresh and self._throttled:
            names = [n for n in names if n not in self._throttled]
        self.sched.activate_many(names)
        if self._fetching:
            self._woken_in_fetch.update(names)

    def subscribed(self) -> None:
        """The wake-up channel was (re)subscribed: wake-ups may have been missed."""
        self.activate_all()
        if self._fetching:
            self._resubscribed_in_fetch = True

    def activate_all(self) -> None:
        self.sched.activate_many(self.sched.queues)

    # -- rate limits -------------------------------------------------------------------
    def throttle(self, waits: Iterable[tuple[str, float]], now: float) -> None:
        """These queues' next jobs are due in so many seconds (the fetch reply's waits;
        the same reply's blocked list deactivated them)."""
        for name, wait in waits:
            if self.sched.consumes(name):  # (not ``in queues``: a set of every queue)
                self._throttled[name] = now + wait

    def next_due(self) -> float | None:
        """When the earliest throttled queue is due (monotonic), or None."""
        return min(self._throttled.values()) if self._throttled else None

    def release_due(self, now: float) -> None:
        """Activate the throttled queues whose next job is due by ``now``."""
        due = [name for name, at in self._throttled.items() if at <= now]
        for name in due:
            del self._throttled[name]
        if due:
            self.woken(due)
