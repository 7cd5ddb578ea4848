"""Periodic job entries set at runtime: one JSON record per entry, checked by one function.

``Client.set_periodic``, ``celery ext periodic set`` and the dashboard's form write an entry
to the hash ``{ns}:periodic_runtime`` (name -> record) after :func:`check_entry` accepted
it; the periodic leader (``worker/periodic_leader.py``) reads the hash on each pass beside
the app's ``beat_schedule`` and turns each record into a celery.beat ``ScheduleEntry``
with :func:`entry_from_record`, which applies the same checks, so a record written by hand
that does not pass them is skipped (and logged), never run or crashing the leader. A
runtime entry wins over the ``beat_schedule`` entry of the same name; when it is removed,
the app's entry comes back. Schedules are Celery's own (``schedule`` for ``every``,
``crontab`` for a five-field string): nothing here parses cron by hand.

A record: ``{"task": str, "every": float | null, "crontab": str | null, "args": list,
"kwargs": dict, "options": dict}``.
"""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime, timedelta
from typing import Any

from celery.beat import ScheduleEntry
from celery.schedules import crontab as celery_crontab
from celery.schedules import schedule as interval_schedule
from kombu.utils.encoding import bytes_to_str

from celery_ext.store.keys import Keys

#: The shortest ``every`` (seconds) an entry may have: the leader's pass and a run's
#: enqueue take milliseconds each, and a sub-second cadence is a loop, not a schedule.
MIN_EVERY = 1.0
#: The longest entry name accepted (it is part of a Redis key and of each run's job id).
MAX_NAME_LENGTH = 200
#: A task name when no app is at hand to say which tasks exist: dotted identifiers.
TASK_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
#: The fields of a crontab string, in cron's order.
CRONTAB_FIELDS = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")


class InvalidPeriodicEntry(ValueError):
    """A periodic job entry that cannot be stored or run; the message says what to change."""

    def __init__(self, name: str, why: str) -> None:
        self.name, self.why = name, why
        super().__init__(f"periodic job entry {name!r}: {why}")


def _crontab(name: str, text: Any, app: Any) -> celery_crontab:
    if not isinstance(text, str) or len(text.split()) != len(CRONTAB_FIELDS):
        raise InvalidPeriodicEntry(
            name, f"crontab must be five fields 'minute hour day-of-month month day-of-week', "
                  f"got {text!r}")
    fields = dict(zip(CRONTAB_FIELDS, text.split(), strict=True))
    try:
        sched = celery_crontab(**fields, app=app)
        tz = app.timezone if app is not None else UTC
        # Celery refuses a day that never occurs in the months given (Feb 30) when it
        # builds the crontab; asking for the next due time catches what is left.
        sched.remaining_estimate(datetime.now(UTC).astimezone(tz))
    except Exception as exc:
        raise InvalidPeriodicEntry(name, f"crontab {text!r} never fires or cannot be read: "
                                         f"{exc}") from None
    return sched


def _every(name: str, every: Any) -> float:
    if isinstance(every, bool) or not isinstance(every, int | float) or not math.isfinite(every):
        raise InvalidPeriodicEntry(name, f"every must be a number of seconds, got {every!r}")
    if every < MIN_EVERY:
        raise InvalidPeriodicEntry(name, f"every must be at least {MIN_EVERY:g} second, "
                                         f"got {every:g}")
    return float(every)


def _json_value(name: str, field: str, value: Any) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidPeriodicEntry(name, f"{field} must be JSON: {exc}") from None


def _unknown_task(app: Any, task: str) -> str | None:
    """Why ``task`` is not one of ``app``'s, or None when it is. The modules a worker of
    the app imports (``imports``, ``include``, autodiscovery) are imported first, so the
    registry holds what the app's workers hold."""
    try:
        app.loader.import_default_modules()
    except Exception as exc:
        if task not in app.tasks:
            return (f"unknown task {task!r} (importing the app's task modules failed: "
                    f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__})")
    if task not in app.tasks:
        return f"unknown task {task!r} (not registered in the app {app.main!r})"
    return None


def check_entry(name: Any, task: Any, every: Any = None, crontab: Any = None,
                args: Any = (), kwargs: Any = None, options: Any = None,
                app: Any = None) -> dict[str, Any]:
    """The record of a valid entry, or :class:`InvalidPeriodicEntry` naming what is wrong:
    exactly one of ``every`` (seconds, at least :data:`MIN_EVERY`) and ``crontab`` (five
    fields that fire at some time); ``task`` a task ``app`` knows, or, with no app at
    hand, a dotted identifier; ``args`` a list, ``kwargs`` and ``options`` objects, all
    JSON. The one check behind the client, the CLI, the JSON API and the leader."""
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_LENGTH \
            or not name.isprintable():
        raise InvalidPeriodicEntry(str(name)[:MAX_NAME_LENGTH],
                                   f"the name must be 1 to {MAX_NAME_LENGTH} printable characters")
    if not isinstance(task, str) or not TASK_NAME.match(task):
        raise InvalidPeriodicEntry(name, f"task must be a task name like 'proj.tasks.add', "
                                         f"got {task!r}")
    unknown = _unknown_task(app, task) if app is not None else None
    if unknown:
        raise InvalidPeriodicEntry(name, unknown)
    if (every is None) == (crontab is None):
        raise InvalidPeriodicEntry(name, "give exactly one schedule: every (seconds) or "
                                         "crontab ('m h dom mon dow')")
    record: dict[str, Any] = {"task": task, "every": None, "crontab": None}
    if every is not None:
        record["every"] = _every(name, every)
    else:
        _crontab(name, crontab, app)
        record["crontab"] = " ".join(crontab.split())
    if not isinstance(args, list | tuple):
        raise InvalidPeriodicEntry(name, f"args must be a list, got {type(args).__name__}")
    for field, value in (("kwargs", kwargs), ("options", options)):
        if value is not None and (not isinstance(value, dict)
                                  or not all(isinstance(k, str) for k in value)):
            raise InvalidPeriodicEntry(name, f"{field} must be an object with string keys")
    record.update(args=list(args), kwargs=dict(kwargs or {}), options=dict(options or {}))
    for field in ("args", "kwargs", "options"):
        _json_value(name, field, record[field])
    return record


def entry_from_record(name: str, raw: str | bytes, app: Any) -> ScheduleEntry:
    """A stored record as celery.beat's entry for ``app``, checked by :func:`check_entry`
    (task names as dotted identifiers: the leader's app need not hold every task the
    other pools run). Raises :class:`InvalidPeriodicEntry` for a broken record."""
    try:
        record = json.loads(raw)
    except ValueError:
        raise InvalidPeriodicEntry(name, "the stored record is not JSON") from None
    if not isinstance(record, dict):
        raise InvalidPeriodicEntry(name, "the stored record is not a JSON object")
    unknown = set(record) - {"task", "every", "crontab", "args", "kwargs", "options"}
    if unknown:
        raise InvalidPeriodicEntry(name, f"unknown fields {sorted(unknown)}")
    checked = check_entry(name, record.get("task"), record.get("every"), record.get("crontab"),
                          record.get("args", []), record.get("kwargs"), record.get("options"))
    sched: Any
    if checked["every"] is not None:
        sched = interval_schedule(timedelta(seconds=checked["every"]), app=app)
    else:
        sched = _crontab(name, checked["crontab"], app)
    return ScheduleEntry(name=name, task=checked["task"], schedule=sched, args=checked["args"],
                         kwargs=checked["kwargs"], options=checked["options"], app=app)


def encode(record: dict[str, Any]) -> str:
    """A checked record as stored (compact, keys sorted: equal records, equal text)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


def read_records(client: Any, keys: Keys) -> dict[str, str]:
    """Every stored runtime entry: name -> its record's text (unchecked)."""
    return {bytes_to_str(k): bytes_to_str(v)
            for k, v in client.hgetall(keys.periodic_runtime).items()}
