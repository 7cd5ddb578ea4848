"""The schedule maths of periodic jobs: pure functions over Celery's own schedules.

``app.conf.beat_schedule`` is read with ``celery.beat``'s ``ScheduleEntry`` and each due
time is the entry's Celery schedule (``crontab``, ``schedule``/timedelta/number,
``solar``) asked what comes after a given moment, with that moment as its "now" (the
leader passes Redis ``TIME``). :func:`plan` decides what the leader does about the due
times pending for one entry. Nothing here reads Redis or a host clock.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from celery.beat import ScheduleEntry
from celery.schedules import crontab
from celery.schedules import schedule as interval_schedule

from celery_ext.text import one_line

logger = logging.getLogger("celery_ext.options.periodic_schedule")

#: Most due times of one entry computed in one pass (a long outage of a frequent entry
#: is jumped over, not walked).
MAX_DUE_TIMES = 1000
def load_entries(app: Any) -> dict[str, ScheduleEntry]:
    """``app.conf.beat_schedule`` as celery.beat's entries; an entry Celery cannot read
    is left out with one log line. (A ``countdown`` or ``eta`` in an entry's options
    makes each run wait in the scheduled set: ``producer/periodic_run.py``.)"""
    entries: dict[str, ScheduleEntry] = {}
    for name, spec in dict(app.conf.beat_schedule or {}).items():
        try:
            entry = ScheduleEntry(**dict(spec, name=name, app=app))
            if not entry.task or entry.schedule is None:
                raise ValueError("needs 'task' and 'schedule'")
        except Exception as exc:
            logger.error("celery_ext: periodic entry %s left out: %s", one_line(str(name)),
                         one_line(str(exc)))
            continue
        entries[str(name)] = entry
    return entries


def _aware(ms: int, tz: Any) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).astimezone(tz)


def next_due_ms(sched: Any, after_ms: int, tz: Any) -> int:
    """The first due time of ``sched`` after ``after_ms`` (ms since the epoch): Celery's
    ``remaining_estimate`` asked at ``after_ms`` with ``after_ms`` as its now."""
    at = _aware(after_ms, tz)
    probe = copy.copy(sched)
    probe.nowfun = lambda: at
    # Celery answers in real (UTC) time, also across a DST change: add it as such.
    due = after_ms + round(probe.remaining_estimate(at).total_seconds() * 1000)
    return due if due > after_ms else after_ms + 1  # a zero-length schedule still moves on


def due_times(sched: Any, next_due: int, now_ms: int, tz: Any,
              limit: int = MAX_DUE_TIMES) -> tuple[list[int], int]:
    """(due times from ``next_due`` up to ``now_ms``, at most ``limit``; the due time
    after the last of them). Past the limit, the second is the first due time after
    ``now_ms`` and the rest are jumped over."""
    dues: list[int] = []
    due = next_due
    while due <= now_ms:
        if len(dues) == limit:
            return dues, next_due_ms(sched, now_ms, tz)
        dues.append(due)
        due = next_due_ms(sched, due, tz)
    return dues, due


@dataclass(frozen=True)
class Step:
    """One call of ``periodic_run.lua`` the leader makes."""

    expected_ms: int
    due_ms: int
    next_ms: int
    passed: int
    enqueue: bool


def plan(dues: list[int], following: int, now_ms: int, grace_ms: int, policy: str,
         paused: bool = False) -> list[Step]:
    """What to do about the pending due times ``dues`` (oldest first, all come) of one
    entry. A due time is *missed* when a later one has come too (a leader failover,
    every pool down, a pass slower than the period) or when it is more than ``grace_ms``
    late; the policy (``periodic_missed``) decides what missed due times get: ``once``
    one run for all of them (for the latest due time), ``skip`` none, ``all`` one each.
    A due time that is not missed has its own run."""
    if not dues:
        return []
    latest = dues[-1]
    if paused:
        return [Step(dues[0], latest, following, len(dues), False)]
    on_time = now_ms - latest <= grace_ms
    if policy == "all" or (len(dues) == 1 and on_time):
        nexts = [*dues[1:], following]
        return [Step(d, d, n, 0, True) for d, n in zip(dues, nexts, strict=True)]
    if policy == "skip" and not on_time:
        return [Step(dues[0], latest, following, len(dues), False)]
    # "once": one run stands for them all; "skip": the latest, on time, runs on its own.
    return [Step(dues[0], latest, following, len(dues) - 1, True)]


def describe(sched: Any) -> str:
    """A schedule for people: ``every 10s``, ``crontab(*/15 * * * *)``, ``<solar: ...>``."""
    if isinstance(sched, crontab):
        return (f"crontab({sched._orig_minute} {sched._orig_hour} {sched._orig_day_of_month} "
                f"{sched._orig_month_of_year} {sched._orig_day_of_week})")
    if isinstance(sched, interval_schedule):
        seconds = sched.run_every.total_seconds()
        return f"every {seconds:g}s"
    return repr(sched)


def spec(entry: ScheduleEntry, tz: Any) -> str:
    """What makes an entry's due times: its task, its schedule and the app's time zone
    (a crontab's hours are the zone's). When it changes, next_due is computed anew; pools
    whose apps have different time zones see each other's due times as changed."""
    return f"{entry.task} {entry.schedule!r} {tz}"

