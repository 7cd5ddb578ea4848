"""The dashboard's JSON API (see ``docs/dashboard.md``): reads, actions (POST, CSRF-checked
by the guard), a job's event stream and the Prometheus metrics.

Every handler talks to Redis only through the :class:`celery_ext.client.Client` in
``request.app.state.client``; a few are bound to a set or an action with
``functools.partial`` in the route table (``app.py``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import redis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from celery_ext import __version__
from celery_ext.admin.client import Client, InvalidPeriodicEntry
from celery_ext.admin.job_status import FINAL_STATES
from celery_ext.admin.search import Filters
from celery_ext.admin.web.series import Sampler
from celery_ext.errors import CONNECTION_ERRORS

logger = logging.getLogger("celery_ext.admin.web")

#: Seconds between two status reads of one job in its event stream.
JOB_POLL_INTERVAL = 0.5
#: A job event stream ends after this many seconds (EventSource reconnects by itself).
JOB_STREAM_MAX = 300.0
#: Every how many polls the event stream also searches the scheduled/retry sets.
JOB_DEEP_EVERY = 6
#: Default and largest page size of list endpoints.
PAGE_DEFAULT = 100
PAGE_MAX = 1000
#: Largest ``offset`` of list endpoints: the largest integer a browser's JSON keeps exact,
#: far past any set's size and well inside the 64-bit range Redis takes for an index.
OFFSET_MAX = 2**53 - 1


def _client(request: Request) -> Client:
    client: Client = request.app.state.client
    return client


# -- request parsing ------------------------------------------------------------------------
def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    """An integer query parameter between ``low`` and ``high``; anything else is a 400
    naming it (passed on, a huge number would be refused by Redis, not by us)."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise HTTPException(400, f"{name!r} must be an integer from {low} to {high}")
    return value


def _page_args(request: Request) -> tuple[int, int]:
    return (_int_param(request, "offset", 0, 0, OFFSET_MAX),
            _int_param(request, "limit", PAGE_DEFAULT, 1, PAGE_MAX))


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        raise HTTPException(400, "expected a JSON object body") from None
    if not isinstance(body, dict):
        raise HTTPException(400, "expected a JSON object body")
    return body


def _str_field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise HTTPException(400, f"{name!r} must be a non-empty string")
    return value


def _ids_or_all(body: dict[str, Any]) -> list[str] | None:
    """``{"ids": [...]}`` -> the ids; ``{"all": true}`` -> None."""
    if body.get("all") is True:
        return None
    ids = body.get("ids")
    if isinstance(ids, str):
        ids = [ids]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise HTTPException(400, "give 'ids' (a list of strings) or 'all': true")
    return ids


def _filters(values: Any) -> Filters:
    """Search filters from query parameters or a JSON body (name, error, text, since,
    until; times in seconds); a bad one is a 400 naming it."""
    def text(name: str) -> str:
        value = values.get(name) or ""
        if not isinstance(value, str):
            raise HTTPException(400, f"{name!r} must be a string")
        return value.strip()

    def when(name: str) -> float | None:
        value = values.get(name)
        if value in (None, ""):
            return None
        try:
            return float(value)
        except (TypeError, ValueError):
            raise HTTPException(400, f"{name!r} must be a time in seconds") from None
    try:
        return Filters(name=text("name"), error=text("error"), text=text("text"),
                       since=when("since"), until=when("until"))
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None


def _light(item: dict[str, Any]) -> dict[str, Any]:
    """A set entry without its bulky fields (payload, traceback), for list views."""
    return {k: v for k, v in item.items() if k not in ("payload", "traceback")}


# -- reads ----------------------------------------------------------------------------------
def overview(request: Request) -> JSONResponse:
    client = _client(request)
    sampler: Sampler = request.app.state.sampler
    queues = client.job_queues()
    pools = client.worker_pools()
    busy = client.busy_workers()
    sizes = client.counts()
    top = sorted(queues, key=lambda q: (-q["size"], q["name"]))[:10]
    return JSONResponse({
        "server_time": client.server_time(),
        "totals": client.totals(),
        "counts": {
            "queues": len(queues),
            "queued": sum(q["size"] for q in queues),
            "in_flight": sum(q["in_flight"] for q in queues),
            "paused": sum(1 for q in queues if q["paused"]),
            "pools": len(pools),
            "live_pools": sum(1 for p in pools if p["state"] in ("running", "stopping")),
            "busy": len(busy),
            **sizes,
        },
        "top_queues": top,
        "series": sampler.series(),
        "sample_interval": sampler.interval,
    })


def queues(request: Request) -> JSONResponse:
    client = _client(request)
    offset, limit = _page_args(request)
    prefix = request.query_params.get("prefix") or None
    return JSONResponse({"items": client.job_queues(offset, limit, prefix),
                         "total": client.queue_count(prefix),
                         "offset": offset, "limit": limit})


def pools(request: Request) -> JSONResponse:
    return JSONResponse({"items": _client(request).worker_pools()})


def busy(request: Request) -> JSONResponse:
    return JSONResponse({"items": _client(request).busy_workers()})


def chords(request: Request) -> JSONResponse:
    """Pending chords of the app's result backend (celery-ext's), with n of m counted."""
    client = _client(request)
    return JSONResponse({"items": client.pending_chords(), "server_time": client.server_time()})


def set_listing(request: Request, *, kind: str) -> JSONResponse:
    """One page of the scheduled, retry or dead set (``kind``), without bulky fields."""
    client = _client(request)
    offset, limit = _page_args(request)
    fetch = {"scheduled": client.scheduled, "retry": client.retries, "dead": client.dead}[kind]
    name = request.query_params.get("name") or None
    page: dict[str, Any] = dict(fetch(offset, limit, name))
    page["items"] = [_light(dict(i)) for i in page["items"]]
    return JSONResponse(page)


def history(request: Request) -> JSONResponse:
    try:
        return JSONResponse(_client(request).history(request.query_params.get("window", "1h")))
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None


def runtimes(request: Request) -> JSONResponse:
    try:
        items = _client(request).runtimes(request.query_params.get("window", "1h"))
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None
    return JSONResponse({"items": items})


def search(request: Request, *, kind: str) -> JSONResponse:
    """A page of the matches in one set, by cursor."""
    client = _client(request)
    params = request.query_params
    filters = _filters(params)
    _offset, limit = _page_args(request)
    try:
        found = client.search(kind, filters, params.get("cursor") or None, limit)
    except ValueError as exc:  # a cursor that is not ours
        raise HTTPException(400, str(exc)) from None
    page: dict[str, Any] = dict(found)
    page["items"] = [_light(dict(i)) for i in page["items"]]
    if params.get("count"):
        page["total"] = client.count_matching(kind, filters)
    return JSONResponse(page)


def dead_job(request: Request) -> JSONResponse:
    job = _client(request).dead_job(request.path_params["dead_id"])
    if job is None:
        raise HTTPException(404, "no such dead job")
    return JSONResponse(job)


def job(request: Request) -> JSONResponse:
    return JSONResponse(_client(request).job(request.path_params["job_id"]))


async def job_events(request: Request) -> EventSourceResponse:
    """Server-sent events of one job's status until it is final (or ``JOB_STREAM_MAX``)."""
    client = _client(request)
    job_id = request.path_params["job_id"]

    async def events() -> AsyncIterator[dict[str, Any]]:
        last = ""
        deep_state: str | None = None
        name: str | None = None
        deadline = time.monotonic() + JOB_STREAM_MAX
        polls = 0
        while time.monotonic() < deadline:
            deep = polls % JOB_DEEP_EVERY == 0
            polls += 1
            try:
                status = await run_in_threadpool(client.job, job_id, deep)
            except redis.RedisError as exc:
                yield {"event": "error", "data": json.dumps({"error": str(exc)})}
                await anyio.sleep(2)
                continue
            name = status["job_name"] = status["job_name"] or name
            if deep:
                deep_state = status["state"]
            elif status["state"] == "queued" and deep_state in ("scheduled", "retrying"):
                status["state"] = deep_state  # not re-searched this time: keep it
            text = json.dumps(status, sort_keys=True)
            if text != last:
                last = text
                yield {"event": "status", "data": text}
            if status["state"] in FINAL_STATES:
                return
            await anyio.sleep(JOB_POLL_INTERVAL)

    return EventSourceResponse(events(), ping=15)


def periodic(request: Request) -> JSONResponse:
    client = _client(request)
    return JSONResponse({"items": client.periodic(), "server_time": client.server_time()})


def csrf(request: Request) -> JSONResponse:
    return JSONResponse({"csrf_token": request.scope.get("state", {}).get("csrf_token")})


def health(request: Request) -> JSONResponse:
    return JSONResponse({"ok": _client(request).ping(), "version": __version__})


def metrics(request: Request) -> Response:
    """Behind the same guard as the API: job names and pool hosts are not public, and
    Prometheus sends a bearer token or basic auth (see docs/operations.md)."""
    return Response(generate_latest(request.app.state.metrics_registry),
                    media_type=CONTENT_TYPE_LATEST)


# -- actions (POST) -------------------------------------------------------------------------
async def pause(request: Request) -> JSONResponse:
    name = _str_field(await _json_body(request), "name")
    changed = await run_in_threadpool(_client(request).pause, name)
    return JSONResponse({"name": name, "paused": True, "changed": changed})


async def resume(request: Request) -> JSONResponse:
    name = _str_field(await _json_body(request), "name")
    changed = await run_in_threadpool(_client(request).resume, name)
    return JSONResponse({"name": name, "paused": False, "changed": changed})


async def rate_limit(request: Request) -> JSONResponse:
    body = await _json_body(request)
    name, rate = _str_field(body, "name"), body.get("rate_limit")
    if rate is not None and not isinstance(rate, str):
        raise HTTPException(400, "rate_limit must be a string like '20/s', or null")
    try:
        stored = await run_in_threadpool(_client(request).set_rate_limit, name, rate or None)
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None
    return JSONResponse({"name": name, "rate_limit": stored})


async def stop(request: Request) -> JSONResponse:
    job_id = _str_field(await _json_body(request), "job_id")
    if not await run_in_threadpool(_client(request).request_stop, job_id):
        raise HTTPException(404, "no such job in flight (only a fetched or running job "
                                 "can be asked to stop)")
    return JSONResponse({"job_id": job_id, "stop_requested": True})


async def cancel(request: Request) -> JSONResponse:
    """Cancel a job by id wherever it is (``Client.cancel``): the outcome says where."""
    job_id = _str_field(await _json_body(request), "job_id")
    outcome = await run_in_threadpool(_client(request).cancel, job_id)
    return JSONResponse({"job_id": job_id, **outcome})


async def revoked(request: Request) -> JSONResponse:
    """The revokes that hold now (the Revoked page), with the Redis clock's time, from
    which the page counts down to each one's lapse."""
    client = _client(request)

    def read() -> dict[str, Any]:
        return {"items": client.revoked(), "server_time": client.server_time()}

    return JSONResponse(await run_in_threadpool(read))


async def scheduled_delete(request: Request) -> JSONResponse:
    job_id = _str_field(await _json_body(request), "id")
    deleted = await run_in_threadpool(_client(request).delete_scheduled, job_id)
    if not deleted:
        raise HTTPException(404, "no such scheduled or retry job")
    return JSONResponse({"id": job_id, "deleted": True})


async def _dead_bulk(request: Request, every: Callable[[], int], one: Callable[[str], bool],
                     done_key: str) -> JSONResponse:
    """Act on the dead jobs a body names (``{"ids": [...]}``: 404 if none was dead) or on
    all of them (``{"all": true}``)."""
    ids = _ids_or_all(await _json_body(request))
    if ids is None:
        return JSONResponse({"count": await run_in_threadpool(every)})
    done = [i for i in ids if await run_in_threadpool(one, i)]
    if not done:
        raise HTTPException(404, "no such dead job")
    return JSONResponse({done_key: done, "count": len(done)})


async def dead_retry(request: Request) -> JSONResponse:
    client = _client(request)
    return await _dead_bulk(request, client.retry_all_dead, client.retry_dead, "retried")


async def dead_delete(request: Request) -> JSONResponse:
    client = _client(request)
    return await _dead_bulk(request, client.delete_all_dead, client.delete_dead, "deleted")


async def search_action(request: Request, *, kind: str, action: str) -> JSONResponse:
    """Retry (``action``) or delete every match in one set; at least one filter."""
    client = _client(request)
    filters = _filters(await _json_body(request))
    if not filters.active:
        raise HTTPException(400, "give at least one filter (name, error, text, "
                                 "since, until); the plain retry/delete act on all")
    do = client.retry_matching if action == "retry" else client.delete_matching
    count = await run_in_threadpool(do, kind, filters)
    return JSONResponse({"count": count})


async def periodic_action(request: Request, *, kind: str) -> JSONResponse:
    """Pause, resume or run now (``kind``) one periodic entry."""
    client = _client(request)
    name = _str_field(await _json_body(request), "name")
    if kind == "run":
        job_id = await run_in_threadpool(client.run_periodic_now, name)
        if job_id is None:
            raise HTTPException(404, "no such periodic job entry")
        return JSONResponse({"name": name, "job_id": job_id})
    changed = await run_in_threadpool(
        client.pause_periodic if kind == "pause" else client.resume_periodic, name)
    if changed is None:
        raise HTTPException(404, "no such periodic job entry")
    return JSONResponse({"name": name, "paused": kind == "pause", "changed": changed})


async def periodic_set(request: Request) -> JSONResponse:
    """Create or replace a runtime periodic entry: ``{"name", "task", "every" (seconds) or
    "crontab" ("m h dom mon dow"), "args", "kwargs", "options", "queue"}``; bad input is a
    400 with the one check's message (``store/runtime_schedules.check_entry``), nothing
    stored. 201 when the entry is new."""
    body = await _json_body(request)
    name: Any = body.get("name")  # checked, with the rest, by check_entry
    task: Any = body.get("task")
    options, queue = body.get("options"), body.get("queue")
    if queue is not None and queue != "":
        if not isinstance(queue, str) or not isinstance(options or {}, dict):
            raise HTTPException(400, "'queue' must be a string (and 'options' an object)")
        options = {**(options or {}), "queue": queue}
    try:
        created = await run_in_threadpool(
            _client(request).set_periodic, name, task,
            body.get("every"), body.get("crontab") or None, body.get("args", []),
            body.get("kwargs"), options)
    except InvalidPeriodicEntry as exc:
        raise HTTPException(400, str(exc)) from None
    return JSONResponse({"name": name, "created": created}, 201 if created else 200)


async def periodic_remove(request: Request) -> JSONResponse:
    """Remove a runtime periodic entry (``DELETE /api/periodic/entries/<name>``)."""
    name = request.path_params["name"]
    if not await run_in_threadpool(_client(request).remove_periodic, name):
        raise HTTPException(404, "no such runtime periodic job entry (entries of the app's "
                                 "beat_schedule are changed in the app)")
    return JSONResponse({"name": name, "removed": True})


async def redis_error(request: Request, exc: Exception) -> Response:
    """A 503 when no server answers (the page retries), a logged 500 for anything else
    (a refused command, a key of the wrong type: a fault of ours or of the data)."""
    if isinstance(exc, CONNECTION_ERRORS):
        return JSONResponse({"error": f"Redis unavailable: {exc}"}, 503)
    logger.error("celery_ext web: %s %s failed: %r", request.method, request.url.path, exc)
    return JSONResponse({"error": f"Redis error: {exc}"}, 500)
