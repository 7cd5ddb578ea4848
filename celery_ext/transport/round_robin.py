"""Weighted round-robin choice among a pool's non-empty job queues (pure, no I/O).

Algorithm: smooth weighted round-robin (SWRR, as in nginx) over *weight classes*,
plain rotation inside a class. All active queues of weight ``w`` form one class of
weight ``w * len(members)``; SWRR picks a class, the class hands out its members in
turn. Cost per pick is O(number of distinct weights), not O(number of queues), so
a pool consuming 1,000 job queues pays the same as one consuming ten; so is a queue's
switch between active and inactive (O(1): a class's members are an ordered dict, where
a deque's ``remove`` scanned them all: with 10,000 job names that emptied as they were
drained, 7.5 % of a worker's main process).

Guarantee while the set of non-empty queues is stable (W = total weight of the
active queues): the pick sequence is periodic with period W, and *every* window of
W consecutive picks holds exactly ``w_i`` picks of queue ``i``. So each queue's
share equals its weight share, and no queue waits more than ``W - w_i`` picks.
(A bound of ``W / w_i`` for every queue at once cannot be met by any scheduler
for some weights, e.g. 7, 5, 1; see tests/unit/test_sampler.py.)

Right after queues empty or refill, the running scores carry over, so the first
picks of the new set may bunch (no queue waits more than twice the total weight);
windows are exact again after that. Resetting the scores on every change would be
worse: a queue that keeps emptying and refilling could starve the lighter ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping


class _WeightClass:
    __slots__ = ("current", "members", "weight")

    def __init__(self, weight: int) -> None:
        self.weight = weight
        #: The active queues of this weight, the next to be picked first (values unused).
        self.members: OrderedDict[str, None] = OrderedDict()
        self.current = 0


class WeightedRoundRobin:
    """Picks job queues for a pool; queues are switched active/inactive as they fill/empty."""

    def __init__(self, weights: Mapping[str, int] | None = None, default_weight: int = 1) -> None:
        self.default_weight = default_weight
        self._weights: dict[str, int] = {}
        self._active: set[str] = set()
        self._classes: dict[int, _WeightClass] = {}
        self._total = 0
        if weights:
            self.set_queues(weights)

    # -- membership ---------------------------------------------------------------------
    @property
    def queues(self) -> frozenset[str]:
        return frozenset(self._weights)

    @property
    def active(self) -> frozenset[str]:
        return frozenset(self._active)

    def has_active(self) -> bool:
        return bool(self._active)

    def all_active(self) -> bool:
        """Whether no consumed queue is believed empty (O(1), unlike ``active``)."""
        return len(self._active) == len(self._weights)

    def weight(self, name: str) -> int:
        return self._weights.get(name, self.default_weight)

    def consumes(self, name: str) -> bool:
        """Whether ``name`` is one of the consumed queues (O(1), unlike ``queues``)."""
        return name in self._weights

    def set_queues(self, weights: Mapping[str, int], activate: bool = True) -> None:
        """Replace the consumed queues; new ones start active (their emptiness is unknown)."""
        self.remove_queues([name for name in self._weights if name not in weights])
        self.add_queues(weights, activate)

    def remove_queues(self, names: Iterable[str]) -> None:
        """Stop consuming these queues (unknown names are ignored)."""
        for name in names:
            if name in self._weights:
                self.deactivate(name)
                del self._weights[name]

    def add_queues(self, weights: Mapping[str, int], activate: bool = True) -> None:
        """Add (or re-weight) consumed queues and keep the others; costs O(len(weights)),
        for a pool that starts consuming its queues one at a time."""
        for name, weight in weights.items():
            weight = int(weight)
            if weight < 1:
                raise ValueError(f"weight of job queue {name!r} must be >= 1, got {weight}")
            old = self._weights.get(name)
            if old is not None and old != weight and name in self._active:
                self.deactivate(name)
                self._weights[name] = weight
                self.activate(name)
            else:
                self._weights[name] = weight
                if old is None and activate:
                    self.activate(name)

    def activate(self, name: str) -> bool:
        """Mark a consumed queue as holding jobs. Returns False for queues not consumed."""
        if name not in self._weights:
            return False
        if name in self._active:
            return True
        weight = self._weights[name]
        cls = self._classes.get(weight)
        if cls is None:
            cls = self._classes[weight] = _WeightClass(weight)
        cls.members[name] = None
        self._active.add(name)
        self._total += weight
        return True

    def activate_many(self, names: Iterable[str]) -> int:
        return sum(1 for name in names if name not in self._active and self.activate(name))

    def deactivate(self, name: str) -> None:
        """Mark a queue as empty: it is skipped until activated again."""
        if name not in self._active:
            return
        weight = self._weights[name]
        cls = self._classes[weight]
        del cls.members[name]
        self._active.discard(name)
        self._total -= weight
        if not cls.members:
            del self._classes[weight]

    # -- picking ------------------------------------------------------------------------
    def pick(self) -> str | None:
        """The next queue to fetch from, or None when no queue is active."""
        classes = self._classes
        if not classes:
            return None
        if len(classes) == 1:
            members = next(iter(classes.values())).members
        else:
            best: _WeightClass | None = None
            for cls in classes.values():
                cls.current += cls.weight * len(cls.members)
                if best is None or cls.current > best.current:
                    best = cls
            assert best is not None
            best.current -= self._total
            members = best.members
        name = next(iter(members))
        members.move_to_end(name)
        return name

    def take(self, n: int) -> list[str]:
        """The next ``n`` picks (repeats allowed); empty when nothing is active."""
        if not self._classes:
            return []
        return [self.pick() for _ in range(n)]  # type: ignore[misc]
