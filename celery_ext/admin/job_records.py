"""A job of the scheduled, retry or dead set as a person sees it, read from its record.

A set's record is ``"<meta json>\\n<queue>\\n<payload>"`` (``celery_ext.store.dead_set``):
the meta line is ours, the payload is the Kombu message as it was published, written by
whoever sent it. Everything read from the payload is checked for its type, so a message
in any shape is shown (with None where a field cannot be read), never refused.

A manual retry from the dead set enqueues :func:`manual_retry_payload`: the message with
its attempts reset and one more manual retry counted.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from kombu.utils.json import dumps

from celery_ext.admin.api_types import DeadJob, ScheduledJob
from celery_ext.options.fair import message_fair_key
from celery_ext.store.compact import COMPACT_START, pack
from celery_ext.store.dead_set import split_record
from celery_ext.store.envelope import decode_message

#: Header counting how often a person retried a job from the dead set.
MANUAL_RETRIES_HEADER = "celery_ext_manual_retries"


def _headers(message: dict[str, Any]) -> dict[str, Any]:
    headers = message.get("headers")
    return headers if isinstance(headers, dict) else {}


def _body_args(message: dict[str, Any]) -> tuple[Any, Any]:
    """(args, kwargs) of a JSON task message (protocol 2); (None, None) otherwise."""
    try:
        if message.get("content-type") != "application/json":
            return None, None
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args, kwargs, *_ = json.loads(body)
        return args, kwargs
    except Exception:
        return None, None


def whole_number(value: Any) -> int:
    """A count from a header that anyone could have written: 0 unless a whole number."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value == value and abs(value) < 2**63 else 0  # not NaN/inf
    try:
        return int(value) if isinstance(value, str) else 0
    except ValueError:
        return 0


def _str_or_none(value: Any) -> str | None:
    """A header meant to be a string (task id, eta); anything else is shown as None."""
    return value if isinstance(value, str) else None


def _job_name(meta: dict[str, Any], queue: str, message: dict[str, Any]) -> str:
    return str(meta.get("name") or _headers(message).get("task") or queue)


def name_of(raw: bytes) -> str:
    """The job name of a set's record: its meta's, else its message's task, else its
    queue (the ``search`` script's rule)."""
    meta, queue, payload = split_record(raw)
    if meta.get("name"):
        return str(meta["name"])
    return _job_name(meta, queue, decode_message(payload, queue))


def _shown(payload: str, message: dict[str, Any]) -> str:
    """The raw message of a dead job as its sender wrote it: a compact payload
    (``store/compact.py``) is shown as the message it stands for."""
    return str(dumps(message)) if message and payload.startswith(COMPACT_START) else payload


def manual_retry_payload(payload: str, queue: str, now: float) -> str:
    """The message a manual retry enqueues: attempts reset, no eta or expiry left
    over from the failed run, one more manual retry counted, and enqueued ``now``
    (Redis seconds), so its queue's latency counts from the retry, not the first
    enqueue. Stored compact, as the producer stores a job (``store/compact.py``)."""
    message = decode_message(payload, queue)
    headers = message.get("headers")
    if not isinstance(headers, dict):
        return payload  # undecodable: requeued as it is
    headers["retries"] = 0
    headers["eta"] = None
    headers["expires"] = None
    headers[MANUAL_RETRIES_HEADER] = whole_number(headers.get(MANUAL_RETRIES_HEADER)) + 1
    props = message.get("properties")
    if isinstance(props, dict):  # (kept in place: it stays after the delivery tag)
        props["enqueued_at"] = round(now, 3)
    return pack(message, queue)


def scheduled_job(job_id: str, score: float, raw: bytes) -> ScheduledJob:
    """A job of the scheduled or retry set; ``score`` is its due time (ms)."""
    meta, queue, payload = split_record(raw)
    message = decode_message(payload, queue)
    headers = _headers(message)
    args, kwargs = _body_args(message)
    scheduled_at = meta.get("scheduled_at")
    return ScheduledJob(
        id=job_id,
        name=_job_name(meta, queue, message),
        task_id=_str_or_none(headers.get("id")) or meta.get("task_id"),
        queue=queue,
        args=args,
        kwargs=kwargs,
        due_at=score / 1000,
        scheduled_at=scheduled_at / 1000 if isinstance(scheduled_at, int | float) else None,
        retry=bool(meta.get("retry")),
        attempt=whole_number(meta.get("attempt") or headers.get("retries")),
        error=meta.get("error"),
        exc_type=meta.get("exc_type"),
        traceback=meta.get("traceback"),
        eta=_str_or_none(headers.get("eta")),
        expires=_str_or_none(headers.get("expires")),
    )


def dead_job(job_id: str, score: float, raw: bytes, with_payload: bool = False) -> DeadJob:
    """A job of the dead set; ``score`` is when it failed (ms). The raw message only
    ``with_payload`` (one job's page, not a list)."""
    meta, queue, payload = split_record(raw)
    message = decode_message(payload, queue)
    headers = _headers(message)
    args, kwargs = (meta["args"], meta["kwargs"]) if "args" in meta else _body_args(message)
    attempts = meta.get("attempts")
    if attempts is None and "retries" in headers:
        attempts = whole_number(headers.get("retries")) + 1
    return DeadJob(
        id=job_id,
        name=_job_name(meta, queue, message),
        task_id=meta.get("task_id") or _str_or_none(headers.get("id")),
        queue=queue,
        reason=str(meta.get("reason", "")),
        error=str(meta.get("error", "")),
        exc_type=meta.get("exc_type"),
        exc_message=meta.get("exc_message"),
        traceback=meta.get("traceback"),
        args=args,
        kwargs=kwargs,
        attempts=attempts,
        pool=meta.get("pool"),
        hostname=meta.get("hostname"),
        failed_at=score / 1000,
        manual_retries=whole_number(headers.get(MANUAL_RETRIES_HEADER)),
        payload=_shown(payload, message) if with_payload else None,
        fair_key=message_fair_key(message),
    )
