"""When a worker pool counts as dead: the one rule the reaper and the dashboard share.

Each pool records its own ``dead_after`` and ``heartbeat_interval`` when it registers
(:func:`registration_fields`, in ``{ns}:pool:<id>``), so whoever judges it (a reaper
in another pool, ``celery ext reap``, the dashboard) uses the pool's values, not its
own: a reaper started with a smaller ``dead_after`` never reaps a pool that
heartbeats more slowly. A pool registered by an older version, without them, is
judged by the judge's settings.

A pool also records which job queues it consumes (:data:`QUEUES_FIELD`, kept up to
date by its channel), so the readers can tell a job queue no live pool consumes
(:func:`consumed_queues`): its jobs wait for a worker that knows the task.

A heartbeat is old either because the pool stopped or because Redis could not be
reached (an outage or a stall makes every heartbeat old at once). So a pool is
reaped only by a judge that has seen Redis answer steadily for
:attr:`Liveness.confirm_ms` of that pool: two of its heartbeat intervals and a
second, in which a live pool has stamped again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from celery_ext.config import Settings

#: Registration fields (milliseconds) of the pool hash that carry its own timings.
DEAD_AFTER_FIELD = "dead_after_ms"
HEARTBEAT_INTERVAL_FIELD = "heartbeat_interval_ms"
LIVENESS_FIELDS = (DEAD_AFTER_FIELD, HEARTBEAT_INTERVAL_FIELD)
#: Registration field: the job queues the pool consumes, one name a line (a job queue's
#: name holds no newline: the channel refuses one). Written with the registration and
#: whenever the pool's consumers change, so it lives and dies with the pool hash.
QUEUES_FIELD = "consumes"
#: The field older versions wrote instead (install(app) only, at worker_ready): names
#: joined by commas. Read when :data:`QUEUES_FIELD` is missing.
OLD_QUEUES_FIELD = "queues"
#: Both, for an HMGET that :func:`queues_of` reads.
QUEUES_FIELDS = (QUEUES_FIELD, OLD_QUEUES_FIELD)
#: Registration field of a pool's state: "running", or "stopping" after a warm shutdown
#: began (it fetches nothing more).
STATE_FIELD = "state"
#: Added to two heartbeat intervals of steady Redis before a pool may be judged (the
#: time a heartbeat takes to be sent, reconnect and run).
CONFIRM_SLACK_MS = 1000


def registration_fields(settings: Settings) -> dict[str, int]:
    """What a pool records about its own timings when it registers."""
    return {DEAD_AFTER_FIELD: int(settings.dead_after * 1000),
            HEARTBEAT_INTERVAL_FIELD: int(settings.heartbeat_interval * 1000)}


def queues_field(queues: Iterable[str]) -> str:
    """The value of :data:`QUEUES_FIELD` for these job queues."""
    return "\n".join(sorted(set(queues)))


def _field(info: Mapping[Any, Any], field: str) -> str | None:
    raw = info.get(field, info.get(field.encode()))
    if raw is None:
        return None
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def queues_of(info: Mapping[Any, Any]) -> list[str] | None:
    """The job queues a pool hash says the pool consumes (str or bytes keys), sorted;
    None when it does not say (a pool of an older version in drop-in mode)."""
    text = _field(info, QUEUES_FIELD)
    if text is not None:
        return sorted(q for q in text.split("\n") if q)
    old = _field(info, OLD_QUEUES_FIELD)
    return None if old is None else sorted(q for q in old.split(",") if q)


def consumes(info: Mapping[Any, Any], queue: str) -> bool:
    """Does the pool of this hash consume ``queue``? A pool that does not say counts
    as consuming every queue (no false alarm while older pools run)."""
    names = queues_of(info)
    return names is None or queue in names


def _ms(info: Mapping[Any, Any], field: str) -> int | None:
    raw = info.get(field, info.get(field.encode()))
    try:
        value = int(raw)
    except (TypeError, ValueError):
        return None
    return value if value > 0 else None


@dataclass(frozen=True)
class Liveness:
    """One pool's timings, as it registered them (or the judge's, for older pools)."""

    dead_after_ms: int
    heartbeat_interval_ms: int

    @classmethod
    def of(cls, info: Mapping[Any, Any] | None, settings: Settings) -> Liveness:
        """From a pool hash (str or bytes keys); missing values fall back to ``settings``."""
        info = info or {}
        return cls(
            dead_after_ms=_ms(info, DEAD_AFTER_FIELD) or int(settings.dead_after * 1000),
            heartbeat_interval_ms=(_ms(info, HEARTBEAT_INTERVAL_FIELD)
                                   or int(settings.heartbeat_interval * 1000)))

    def deadline(self, now_ms: int) -> int:
        """A heartbeat stamped before this (Redis time, ms) is stale."""
        return now_ms - self.dead_after_ms

    def stale(self, beat_ms: float | None, now_ms: int) -> bool:
        """Is a heartbeat stamped at ``beat_ms`` (None: not registered) too old?"""
        return beat_ms is None or beat_ms < self.deadline(now_ms)

    @property
    def confirm_ms(self) -> int:
        """How long a judge must have seen Redis answer without a gap before it may
        call this pool dead: after an outage or stall a live pool stamps again within
        one heartbeat interval."""
        return 2 * self.heartbeat_interval_ms + CONFIRM_SLACK_MS


@dataclass(frozen=True)
class Consumed:
    """The job queues the live worker pools consume (``name in consumed``); ``every``
    when one of them does not say (a pool of an older version): every queue counts."""

    names: frozenset[str] = frozenset()
    every: bool = False

    def __contains__(self, name: object) -> bool:
        return self.every or name in self.names


#: What a reader that did not look assumes: every queue is consumed (nothing is
#: forgotten for want of a consumer).
EVERY = Consumed(every=True)


def consumed_by(pools: Iterable[tuple[Mapping[Any, Any], float | None]], now_ms: int,
                settings: Settings) -> Consumed:
    """The job queues consumed by the live pools among ``pools`` (each a pool hash and
    its heartbeat, Redis time): those judged alive by the reaper's rule and not
    stopping (a stopping pool fetches nothing more)."""
    out: set[str] = set()
    for info, beat in pools:
        if not info or Liveness.of(info, settings).stale(beat, now_ms) \
                or _field(info, STATE_FIELD) == "stopping":
            continue
        names = queues_of(info)
        if names is None:
            return EVERY
        out.update(names)
    return Consumed(frozenset(out))
