"""The dead set: jobs that will not run again unless a person says so, with why.

Written by the worker side (failures that will not be retried, expired jobs,
unknown task names, undecodable or rejected messages, poison pills); read and
steered through ``celery_ext.client``.

A dead record is ``"<meta json>\\n<queue>\\n<payload>"`` under the job's id (its
delivery tag) in ``{ns}:dead_jobs``, ordered by failed_at in ``{ns}:dead``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from celery import signals
from celery.exceptions import NotRegistered

from celery_ext.config import Settings
from celery_ext.errors import CONNECTION_ERRORS
from celery_ext.store.envelope import decode_message
from celery_ext.store.job_index import index_keys, index_ttl_ms
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.text import one_line

logger = logging.getLogger("celery_ext.store.dead_set")

#: Why a job is dead (the ``reason`` of its record).
REASONS = {
    "failed": "raised and will not be retried (no retries left, or not retried)",
    "expired": "its expires time passed before it could start",
    "unknown_task": "names a task the worker does not know",
    "undecodable": "its message could not be decoded, or its task id or name holds "
                   "control characters (they would forge log lines)",
    "too_large": "its message is larger than max_payload_bytes (found at fetch)",
    "invalid": "its message is not a valid task message",
    "unknown_message": "its message is not a task message",
    "rejected": "rejected by the consumer without requeue",
    "worker_lost": "its worker died under it too often (a poison pill)",
    "revoked": "revoked or cancelled (Celery's revoke, Client.cancel): see store/revoked.py",
}


#: Called with ``(message, record meta)`` for each job this process moved to the dead set
#: (the message as ``envelope.decode_message`` reads it: {} when it is not an object);
#: the result backend (``celery_ext/results/dead_jobs.py``) registers one, so the job's
#: waiters and chord learn why. Nothing is read back when none is registered.
DeadListener = Callable[[dict[str, Any], dict[str, Any]], None]
_listeners: list[DeadListener] = []


def on_dead(listener: DeadListener) -> None:
    """Call ``listener`` for every job this process moves to the dead set (once per
    listener, however often registered)."""
    if listener not in _listeners:
        _listeners.append(listener)


def notify_dead(client: Any, keys: Keys, tags: list[str]) -> None:
    """Hand the dead records of ``tags`` (just moved, in the copy ``keys``) to the
    listeners. A listener's failure is logged: the job is dead either way."""
    if not _listeners or not tags:
        return
    try:
        raws = client.hmget(keys.dead_jobs, tags)
    except CONNECTION_ERRORS as exc:
        logger.warning("celery_ext: could not read %d dead job(s) back: %s", len(tags), exc)
        return
    for raw in raws:
        if raw is None:
            continue
        meta, queue, payload = split_record(raw)
        message = decode_message(payload, queue)
        for listener in list(_listeners):
            try:
                listener(message, meta)
            except Exception as exc:
                logger.warning("celery_ext: a dead-set listener failed: %s", one_line(str(exc)))


#: Tracebacks are cut to their last this many characters (the frames nearest the error).
MAX_TRACEBACK = 8000


def dead_letter(client: Any, settings: Settings, pool_id: str, tag: str, *,
                reason: str, error: str = "", fallback: str | bytes = "",
                keys: Keys | None = None, unique_digest: str | None = None,
                **meta: Any) -> bool:
    """Move one in-flight job of ``pool_id`` to the dead set atomically.

    ``fallback`` (``"<queue>\\n<payload>"``) is recorded when the job is no longer in
    flight because it was acked when it started (``acks_late`` off). Returns False
    when nothing was recorded (the job had already been moved elsewhere). ``keys``:
    the copy holding the pool's record of the job (default the home copy; on a
    cluster the job queue's copy, ``Keys.of``, whose dead set keeps at most
    ``dead_max_size`` jobs). ``unique_digest``: the lock of a job locked until
    finished, released in the same script if this message holds it.
    """
    keys = keys or Keys.for_settings(settings)
    record = json.dumps({"reason": reason, "error": error, "pool": pool_id, **meta},
                        default=repr, separators=(",", ":"))
    moved = Scripts(client)(
        "dead",
        [keys.inflight(pool_id), keys.dead, keys.dead_jobs, keys.redelivery, keys.running,
         keys.limits, keys.ready, *index_keys(keys),
         *([keys.unique(unique_digest)] if unique_digest else [])],
        [tag, record, settings.dead_max_size, int(settings.dead_max_age * 1000), fallback,
         keys.wake_channel, index_ttl_ms(settings), keys.cursor_prefix],
    )
    if moved:
        notify_dead(client, keys, [tag])
    return bool(moved)


def split_record(raw: bytes | str) -> tuple[dict[str, Any], str, str]:
    """Split a ``"<meta json>\\n<queue>\\n<payload>"`` record (dead or scheduled)."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    meta_json, queue, payload = text.split("\n", 2)
    try:
        meta = json.loads(meta_json)
    except ValueError:
        meta = {"error": f"unreadable record meta: {meta_json[:200]!r}"}
    return (meta if isinstance(meta, dict) else {}), queue, payload


def parse_dead_record(raw: bytes | str) -> dict[str, Any]:
    """Split a ``dead_jobs`` value into its meta, queue and payload."""
    record, queue, payload = split_record(raw)
    record["queue"] = queue
    record["payload"] = payload
    return record


def _message_fields(message: Any) -> dict[str, Any]:
    headers = getattr(message, "headers", None)
    if not isinstance(headers, dict):
        return {}
    return {k: headers[k] for k in ("task", "id") if isinstance(headers.get(k), str)}


def wrap_consumer_handlers(consumer: Any) -> None:
    """Make a Celery worker consumer dead-letter what it would log and drop.

    Celery acks an undecodable message and rejects one naming an unknown task or
    with an invalid body; here each is first moved to the dead set with its reason
    (then Celery's handler runs as before: it logs, and its ack or reject finds the
    job already gone).
    """

    def dead(message: Any, reason: str, error: str) -> bool:
        """Dead-letter ``message``; True if recorded (and logged, on one line)."""
        channel = getattr(message, "channel", None)
        dead_letter_ = getattr(channel, "_dead_letter", None)
        if dead_letter_ is None or getattr(message, "acknowledged", False):
            return False
        fields = _message_fields(message)
        try:
            if dead_letter_(message.delivery_tag, reason, error, name=fields.get("task"),
                            task_id=fields.get("id")):
                logger.error("celery_ext: message %s moved to the dead set (%s: %s)",
                             one_line(str(message.delivery_tag)), reason, one_line(error))
                return True
        except Exception as exc:
            logger.error("celery_ext: could not dead-letter message %s: %s",
                         one_line(str(message.delivery_tag)), exc)
        return False

    def reject(message: Any, exc: Exception | None) -> None:
        # What Celery's handler does after logging the whole message and a traceback:
        # the dead set has the message and the line above says why.
        message.reject_log_error(logger, consumer.connection_errors)
        signals.task_rejected.send(sender=consumer, message=message, exc=exc)

    on_decode_error = consumer.on_decode_error
    on_unknown_task = consumer.on_unknown_task
    on_invalid_task = consumer.on_invalid_task
    on_unknown_message = consumer.on_unknown_message

    def decode_error(message: Any, exc: Exception) -> Any:
        if dead(message, "undecodable", f"{type(exc).__name__}: {exc}"):
            return message.ack()
        return on_decode_error(message, exc)

    def unknown_task(body: Any, message: Any, exc: Exception) -> Any:
        fields = _message_fields(message)
        name = fields.get("task", "?")
        if not dead(message, "unknown_task", f"NotRegistered: {name!r}"):
            return on_unknown_task(body, message, exc)
        reject(message, None)
        # As Celery does: the caller's result fails with NotRegistered.
        task_id, props = fields.get("id"), message.properties or {}
        if task_id:
            request = SimpleNamespace(
                id=task_id, name=name, chord=None, errbacks=None, group=None,
                root_id=(message.headers or {}).get("root_id"),
                correlation_id=props.get("correlation_id"), reply_to=props.get("reply_to"))
            try:
                consumer.app.backend.mark_as_failure(task_id, NotRegistered(name),
                                                     request=request)
            except Exception as err:  # the result backend is not the broker
                logger.warning("celery_ext: could not store the failure of %s: %s",
                               one_line(task_id), err)
            if consumer.event_dispatcher:
                consumer.event_dispatcher.send("task-failed", uuid=task_id,
                                               exception=f"NotRegistered({name!r})")
        signals.task_unknown.send(sender=consumer, message=message, exc=exc, name=name,
                                  id=task_id)
        return None

    def invalid_task(body: Any, message: Any, exc: Exception) -> Any:
        if dead(message, "invalid", f"{type(exc).__name__}: {exc}"):
            return reject(message, exc)
        return on_invalid_task(body, message, exc)

    def unknown_message(body: Any, message: Any) -> Any:
        if dead(message, "unknown_message", "not a task message (no task header)"):
            return reject(message, None)
        return on_unknown_message(body, message)

    consumer.on_decode_error = decode_error
    consumer.on_unknown_task = unknown_task
    consumer.on_invalid_task = invalid_task
    consumer.on_unknown_message = unknown_message

    create_task_handler = consumer.create_task_handler

    def guarded_task_handler(*args: Any, **kwargs: Any) -> Any:
        handler = create_task_handler(*args, **kwargs)

        def on_task_received(message: Any) -> Any:
            try:
                return handler(message)
            except CONNECTION_ERRORS:
                raise  # the consumer reconnects, as before
            except Exception as exc:
                # Celery lets anything but InvalidTaskError and DecodeError escape here
                # (a list as task name, a timelimit that is not a pair...), which stops
                # the worker, and the job would stop the next one too: it is invalid.
                return consumer.on_invalid_task(None, message, exc)

        return on_task_received

    consumer.create_task_handler = guarded_task_handler
