"""``celery inspect scheduled`` (and Flower's view of it) answered from Redis.

Celery's worker answers ``scheduled`` from its timer: the countdown and ETA jobs it holds
in memory. Here those jobs wait in Redis (the scheduled and retry sets, see
:mod:`celery_ext.producer.scheduled`) and the timer is empty, so the command is replaced
(:func:`register`, called by ``bootsteps.add_worker_parts``): each worker lists the
jobs of the scheduled and retry sets whose job queue it consumes, the first
``INSPECT_SCHEDULED_MAX`` by due time, in the shape Celery's own reply has
(``{"eta", "priority", "request": {"id", "name", "args", "kwargs", ...}}``). Jobs of
queues a worker does not consume are not its own to run, so they are not listed under
it. A worker whose connection is not ours answers as Celery does.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from celery_ext.config import INSPECT_SCHEDULED_MAX, INSPECT_SCHEDULED_PAGES
from celery_ext.store.compact import unpack
from celery_ext.store.dead_set import split_record
from celery_ext.store.keys import Keys
from celery_ext.text import one_line

logger = logging.getLogger("celery_ext.worker.inspect_scheduled")


def _body(payload: dict[str, Any]) -> tuple[Any, Any]:
    """(args, kwargs) of a stored Kombu message of Celery's protocol 2 (or 1); None, None
    for a body that is not JSON."""
    body: Any = payload.get("body")
    props = payload.get("properties") or {}
    try:
        if props.get("body_encoding") == "base64":
            body = base64.b64decode(body)
        if payload.get("content-type") == "application/json":
            body = json.loads(body)
    except (ValueError, TypeError):
        return None, None
    if isinstance(body, list) and len(body) >= 2:  # protocol 2: [args, kwargs, embed]
        return body[0], body[1]
    if isinstance(body, dict):  # protocol 1
        return body.get("args"), body.get("kwargs")
    return None, None


def _eta(headers: dict[str, Any], due_ms: float) -> str:
    """The job's ``eta`` header as Celery shows it, or its due time in Redis."""
    eta = headers.get("eta")
    if isinstance(eta, str):
        try:
            when = datetime.fromisoformat(eta)
            return (when if when.tzinfo else when.replace(tzinfo=UTC)).isoformat()
        except ValueError:
            pass
    return datetime.fromtimestamp(due_ms / 1000, UTC).isoformat()


def scheduled_entry(raw: bytes | str, due_ms: float, hostname: str,
                    queues: set[str] | None = None) -> dict[str, Any] | None:
    """One job of the scheduled or retry set (its record and due time) as Celery's
    ``scheduled`` reply lists a request; None for a record that is not a Celery job or,
    given ``queues``, whose job queue is not one of them."""
    try:
        _, queue, text = split_record(raw)
        if queues is not None and queue not in queues:
            return None
        payload = unpack(text, queue)
    except ValueError:
        return None
    headers = payload.get("headers") if isinstance(payload, dict) else None
    if not isinstance(headers, dict) or not headers.get("id"):
        return None
    props = payload.get("properties") or {}
    info = props.get("delivery_info") or {}
    priority = props.get("priority") or 0
    args, kwargs = _body(payload)
    return {
        "eta": _eta(headers, due_ms),
        "priority": priority,
        "request": {
            "id": headers.get("id"),
            "name": headers.get("task"),
            "args": args,
            "kwargs": kwargs,
            "type": headers.get("task"),
            "hostname": hostname,
            "time_start": None,
            "acknowledged": False,
            "delivery_info": {"exchange": info.get("exchange", ""),
                              "routing_key": info.get("routing_key") or queue,
                              "priority": priority, "redelivered": False},
            "worker_pid": None,
        },
    }


def scheduled_jobs(client: Any, keys: Keys, queues: Iterable[str], hostname: str,
                   limit: int = INSPECT_SCHEDULED_MAX) -> list[dict[str, Any]]:
    """The first ``limit`` jobs by due time of the scheduled and retry sets whose job queue
    is one of ``queues``, as Celery's ``scheduled`` reply lists them. Each set is read
    from its head in pages of ``limit`` until ``limit`` of them are found, it ends, or
    ``INSPECT_SCHEDULED_PAGES`` pages were read (on one node every queue shares the sets:
    a reply stays bounded when most of them are other workers' jobs)."""
    wanted = set(queues)
    parts = {keys.of(q) for q in wanted}
    found: list[tuple[float, dict[str, Any]]] = []
    for k in sorted(parts, key=lambda c: c.prefix):
        for zset in (k.scheduled, k.retry):
            found += _read(client, k, zset, wanted, hostname, limit)
    found.sort(key=lambda f: f[0])
    return [entry for _, entry in found[:limit]]


def _read(client: Any, k: Keys, zset: str, wanted: set[str], hostname: str,
          limit: int) -> list[tuple[float, dict[str, Any]]]:
    out: list[tuple[float, dict[str, Any]]] = []
    start = 0
    for _ in range(INSPECT_SCHEDULED_PAGES):
        if len(out) >= limit:
            break
        page = client.zrange(zset, start, start + limit - 1, withscores=True)
        if not page:
            break
        start += len(page)
        records = client.hmget(k.scheduled_jobs, [job_id for job_id, _ in page])
        for (_, due), raw in zip(page, records, strict=True):
            entry = scheduled_entry(raw, due, hostname, wanted) if raw is not None else None
            if entry is not None:
                out.append((due, entry))
        if len(page) < limit:
            break
    return out[:limit]


def register() -> None:
    """Replace Celery's ``scheduled`` inspect command (alias ``dump_schedule``) with one
    that reads Redis when the worker's connection is ours. Idempotent."""
    from celery.worker import control

    current: Callable[..., Any] = control.Panel.data.get("scheduled", control.scheduled)
    if getattr(current, "_celery_ext", False):
        return
    celery_scheduled = current

    @control.inspect_command(name="scheduled", alias="dump_schedule")
    def scheduled(state: Any, **kwargs: Any) -> Any:
        """List of scheduled ETA/countdown and retry jobs (from Redis)."""
        consumer = state.consumer
        channel = getattr(getattr(consumer, "connection", None), "default_channel", None)
        pool = getattr(channel, "worker_pool", None)
        if pool is None:
            return celery_scheduled(state, **kwargs)
        queues = [q.name for q in consumer.task_consumer.queues] \
            if getattr(consumer, "task_consumer", None) is not None else []
        try:
            return scheduled_jobs(pool.client, Keys.for_settings(pool.settings), queues,
                                  consumer.hostname)
        except Exception as exc:  # a control reply must not take the worker down
            logger.warning("celery_ext: inspect scheduled could not read Redis: %s",
                           one_line(str(exc)))
            return []

    scheduled._celery_ext = True
