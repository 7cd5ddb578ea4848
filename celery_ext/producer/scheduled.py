"""Producer side of the scheduled and retry sets: jobs with a future due time.

Celery turns ``countdown``/``eta`` (and ``self.retry(...)``, ``autoretry_for``) into
an ``eta`` header. Stock Celery on Redis pushes such a job to its queue at once and
the worker holds it in memory until then; here the producer
(:class:`celery_ext.producer.Enqueuer`) sends it to Redis instead (``{ns}:scheduled``,
or ``{ns}:retry`` for retries) and each pool's requeuer moves it to its job queue
when due (see :mod:`celery_ext.worker.requeuer`).

Due times are on the Redis clock: the delay the producer asked for (``eta`` minus
its own clock) is added to Redis ``TIME`` inside the script, so a producer whose
clock is off still gets the countdown it asked for.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from kombu.utils.json import dumps

from celery_ext.errors import check_payload_size
from celery_ext.options.priority import message_priority
from celery_ext.store.compact import pack
from celery_ext.store.dead_set import MAX_TRACEBACK
from celery_ext.store.keys import Keys


def eta_delay_ms(message: Mapping[str, Any]) -> int | None:
    """Milliseconds until the message's ``eta`` header, or None if it has none or is due.

    An ``eta`` that cannot be parsed is left to the worker, which dead-letters the
    message as invalid.
    """
    headers = message.get("headers")
    if not isinstance(headers, Mapping):
        return None
    eta = headers.get("eta")
    if not eta or not isinstance(eta, str):
        return None
    try:
        when = datetime.fromisoformat(eta)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)  # Celery's default (enable_utc): naive means UTC
    delay = math.ceil((when.timestamp() - time.time()) * 1000)
    return delay if delay > 0 else None


def retries_of(message: Mapping[str, Any]) -> int:
    """The message's retry count (0 for a first attempt)."""
    headers = message.get("headers")
    try:
        return int(headers.get("retries") or 0) if isinstance(headers, Mapping) else 0
    except (TypeError, ValueError):
        return 0


def schedule_meta(message: Mapping[str, Any]) -> dict[str, Any]:
    """What the client shows about a scheduled job besides its payload.

    A retry is published by ``Task.retry`` inside the ``except`` block that caught
    the error (``autoretry_for`` and the ``raise self.retry(exc=exc)`` idiom), so the
    exception being handled is the retry's last error.
    """
    headers = message.get("headers") or {}
    meta: dict[str, Any] = {"name": headers.get("task"), "task_id": headers.get("id")}
    priority = message_priority(message)
    if priority:  # promote.lua pushes the job to its priority level's list (priority.py)
        meta["priority"] = priority
    attempt = retries_of(message)
    if attempt:
        meta["retry"] = True
        meta["attempt"] = attempt
        exc = sys.exc_info()[1]
        if exc is not None:
            meta["exc_type"] = type(exc).__name__
            meta["exc_message"] = str(exc)[:2000]
            meta["error"] = f"{type(exc).__name__}: {meta['exc_message']}"
            meta["traceback"] = traceback.format_exc()[-MAX_TRACEBACK:]
    return meta


def schedule_args(keys: Keys, queue: str, message: dict[str, Any], delay_ms: int,
                  lock: tuple[str, str, int, str] | None = None, max_payload: int = 0,
                  marker: tuple[str, int] | None = None,
                  index_ttl_ms: int = 0) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of the ``schedule`` script for one message.

    ``lock`` = (lock key, lock value, TTL ms, force: "1", "d" or "0", see
    ``schedule.lua``) makes it a unique job; ``marker`` =
    (publish marker key, TTL ms) makes a retry of this publish store nothing (see
    :mod:`celery_ext.producer`); a payload over ``max_payload`` bytes (0 = no limit)
    raises ``PayloadTooLarge``; ``index_ttl_ms`` > 0 keeps the job index (job_index.py).
    """
    retry = retries_of(message) > 0
    target, other = (keys.retry, keys.scheduled) if retry else (keys.scheduled, keys.retry)
    tag = message["properties"]["delivery_tag"]
    meta = dumps(schedule_meta(message))
    payload = pack(message, queue)  # the compact form (store/compact.py)
    check_payload_size(payload, message, queue, max_payload)
    script_keys = [target, keys.scheduled_jobs, other, keys.queues, keys.job_index,
                   keys.job_index_done]
    args: list[Any] = [tag, delay_ms, meta, queue, payload, keys.schedule_channel,
                       index_ttl_ms, str((message.get("headers") or {}).get("id") or "")]
    if lock is not None:
        lock_key, value, ttl_ms, force = lock
        script_keys.append(lock_key)
        args += [value, ttl_ms, force]
    if marker is not None:
        if lock is None:
            args += ["", "", ""]
        script_keys.append(marker[0])
        args.append(marker[1])
    return script_keys, args


def schedule(scripts: Callable[..., Any], keys: Keys, queue: str, message: dict[str, Any],
             delay_ms: int, client: Any, lock: tuple[str, str, int, str] | None = None,
             max_payload: int = 0, marker: tuple[str, int] | None = None,
             index_ttl_ms: int = 0) -> tuple[bool, str]:
    """Store one message in the scheduled or retry set.

    Returns (stored, task id of the pending job): stored is False when ``lock`` was
    held by another pending unique job, whose task id is returned, or when ``marker``
    says this publish stored its job already.
    """
    script_keys, args = schedule_args(keys, queue, message, delay_ms, lock, max_payload,
                                      marker, index_ttl_ms)
    ok, _due, holder = scripts("schedule", script_keys, args, client=client)
    return bool(ok), holder.decode() if isinstance(holder, bytes) else str(holder)
