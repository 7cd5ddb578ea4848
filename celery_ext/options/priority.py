"""Celery's per-message ``priority`` inside one job queue, as Kombu's Redis transport
means it.

A job's priority is the ``priority`` message property (Celery writes it from the task
option, ``apply_async(priority=...)`` or ``task_default_priority``; Kombu writes 0
when none is given). As with ``redis://``: it is clamped to 0-9, a missing or
unreadable one counts as 0, and it is rounded *down* to one of the configured
``priority_steps`` (default 0, 3, 6, 9), its **level**. The lower level runs first.

Each level of a job queue is one Redis list (``Keys.queue_level``); fetch pops the
lowest non-empty level of a queue, so ordering costs a fixed number of list commands
per job, never a sorted-set scan. Across job queues nothing changes: the weighted
round-robin picks the queue, the priority picks the job within it.

The level is always worked out from the message itself, where the job is written:
by the producer (enqueue, schedule), from the in-flight record's payload when a job
goes back to its queue (requeue, recover, reconcile, restore), from the dead record's
payload (dead-set retry), and from the scheduled record's meta (``priority``, written
by :func:`celery_ext.producer.scheduled.schedule_meta`) when the requeuer promotes it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from typing import Any

from celery_ext.store.compact import unpack

#: Kombu's bounds of a message priority (``virtual.Channel.min/max_priority``).
MIN_PRIORITY, MAX_PRIORITY = 0, 9
#: What a message without a readable priority counts as (Kombu's ``default_priority``).
DEFAULT_PRIORITY = 0


def clamp(value: Any) -> int:
    """A message's priority as Kombu reads it: ``int()`` of it, clamped to 0-9, or 0."""
    try:
        return max(min(int(value), MAX_PRIORITY), MIN_PRIORITY)
    except (TypeError, ValueError, OverflowError):
        return DEFAULT_PRIORITY


def level(priority: Any, steps: Sequence[int]) -> int:
    """The level of a priority: the highest step not above it (Kombu's
    ``Channel.priority``). ``steps`` start at 0 (``Settings`` checks it)."""
    return steps[bisect_right(steps, clamp(priority)) - 1]


def message_priority(message: Mapping[str, Any]) -> int:
    """The clamped priority of a Kombu message dict (0 when it has none)."""
    props = message.get("properties")
    return clamp(props.get("priority") if isinstance(props, Mapping) else None)


def payload_priority(payload: bytes | str) -> int:
    """The clamped priority of a stored payload (0 when it cannot be read: such a job
    still goes back to its queue, at the default level)."""
    try:
        message = unpack(payload.decode("utf-8", "replace") if isinstance(payload, bytes)
                         else payload, "")  # (the priority does not depend on the queue)
    except Exception:
        return DEFAULT_PRIORITY
    return message_priority(message) if isinstance(message, Mapping) else DEFAULT_PRIORITY
