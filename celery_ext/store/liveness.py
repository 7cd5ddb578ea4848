"""When a worker pool counts as dead: the one rule the reaper and the dashboard share.

Each pool records its own ``dead_after`` and ``heartbeat_interval`` when it registers
(:func:`registration_fields`, in ``{ns}:pool:<id>``), so whoever judges it (a reaper
in another pool, ``celery ext reap``, the dashboard) uses the pool's values, not its
own: a reaper started with a smaller ``dead_after`` never reaps a pool that
heartbeats more slowly. A pool registered by an older version, without them, is
judged by the judge's settings.

A heartbeat is old either because the pool stopped or because Redis could not be
reached (an outage or a stall makes every heartbeat old at once). So a pool is
reaped only by a judge that has seen Redis answer steadily for
:attr:`Liveness.confirm_ms` of that pool: two of its heartbeat intervals and a
second, in which a live pool has stamped again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery_ext.config import Settings

#: Registration fields (milliseconds) of the pool hash that carry its own timings.
DEAD_AFTER_FIELD = "dead_after_ms"
HEARTBEAT_INTERVAL_FIELD = "heartbeat_interval_ms"
LIVENESS_FIELDS = (DEAD_AFTER_FIELD, HEARTBEAT_INTERVAL_FIELD)
#: Added to two heartbeat intervals of steady Redis before a pool may be judged (the
#: time a heartbeat takes to be sent, reconnect and run).
CONFIRM_SLACK_MS = 1000


def registration_fields(settings: Settings) -> dict[str, int]:
    """What a pool records about its own timings when it registers."""
    return {DEAD_AFTER_FIELD: int(settings.dead_after * 1000),
            HEARTBEAT_INTERVAL_FIELD: int(settings.heartbeat_interval * 1000)}


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
