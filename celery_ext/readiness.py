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
"""

from __future__ import annotations

from collections.abc import Iterable

from .sampler import WeightedRoundRobin


class ReadyQueues:
    """The active job queues of one channel and the weighted round-robin over them."""

    def __init__(self, default_weight: int) -> None:
        self.sched = WeightedRoundRobin(default_weight=default_weight)
        self._fetching = False
        self._woken_in_fetch: set[str] = set()
        self._resubscribed_in_fetch = False

    # -- what the channel consumes -----------------------------------------------------
    def add(self, queue: str, weight: int) -> None:
        self.sched.add_queues({queue: weight})

    def remove(self, queue: str) -> None:
        self.sched.remove_queues([queue])

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
    def woken(self, names: list[str]) -> None:
        """A wake-up, or the ready set, says these queues hold jobs."""
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
