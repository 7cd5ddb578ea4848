"""The dashboard: HTML pages (Jinja2, autoescaped) and the JSON API behind them.

Pages are thin shells: ``static/app.js`` fetches ``/api/...`` every couple of
seconds and renders with ``textContent`` only, so job data can never become markup.
Every route talks to Redis only through :class:`celery_ext.client.Client`.
See ``docs/dashboard.md`` for the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from importlib import resources
from typing import Any

import anyio
import redis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from celery_ext import __version__
from celery_ext.admin.client import Client
from celery_ext.admin.job_status import FINAL_STATES
from celery_ext.admin.metrics import registry_for
from celery_ext.admin.search import KINDS, Filters
from celery_ext.admin.web.security import Guard
from celery_ext.admin.web.series import DEFAULT_HISTORY, DEFAULT_INTERVAL, Sampler

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
#: Seconds between two page refreshes in the browser.
REFRESH_SECONDS = 2.0

PAGES = (
    ("overview", "/", "Overview"),
    ("queues", "/queues", "Job queues"),
    ("pools", "/pools", "Worker pools"),
    ("busy", "/busy", "Busy workers"),
    ("scheduled", "/scheduled", "Scheduled"),
    ("retry", "/retry", "Retry"),
    ("dead", "/dead", "Dead"),
    ("periodic", "/periodic", "Periodic"),
)
#: Pages with a template of their own (the others use page.html).
PAGE_TEMPLATES = {"periodic": "periodic.html"}

_package = resources.files("celery_ext.admin.web")


def _page_args(request: Request) -> tuple[int, int]:
    try:
        offset = max(0, int(request.query_params.get("offset", 0)))
        limit = int(request.query_params.get("limit", PAGE_DEFAULT))
    except ValueError:
        raise HTTPException(400, "offset and limit must be integers") from None
    return offset, min(max(1, limit), PAGE_MAX)


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
    until; times in seconds)."""
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


def create_app(client: Client, *, token: str | None = None, basic_auth: str | None = None,
               allowed_hosts: Iterable[str] | None = None, allow_origins: Iterable[str] = (),
               sample_interval: float = DEFAULT_INTERVAL, history: float = DEFAULT_HISTORY,
               refresh: float = REFRESH_SECONDS) -> Starlette:
    """Build the dashboard ASGI app around ``client``.

    ``token``/``basic_auth`` ("user:password") turn authentication on;
    ``allowed_hosts`` restricts the Host header (DNS rebinding); ``allow_origins``
    lets other sites read ``/api/jobs/...`` (the embeddable widget).
    """
    if basic_auth and ":" not in basic_auth:
        raise ValueError("basic auth must be given as USER:PASSWORD")
    templates = Jinja2Templates(directory=str(_package.joinpath("templates")))
    templates.env.autoescape = True  # every template, whatever its extension
    sampler = Sampler(client, sample_interval, history)

    async def sample_forever() -> None:
        failing = False  # log an outage once, not every interval
        while True:
            try:
                await run_in_threadpool(sampler.sample)
                if failing:
                    logger.warning("celery_ext web: Redis reachable again")
                failing = False
            except redis.RedisError as exc:
                if not failing:
                    logger.warning("celery_ext web: cannot sample counters: %s", exc)
                failing = True
            except Exception:
                logger.exception("celery_ext web: sampler failed")
            await asyncio.sleep(sampler.interval)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(sample_forever())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    guard_auth = bool(token or basic_auth)

    def context(request: Request, name: str, **extra: Any) -> dict[str, Any]:
        return {
            "page": name, "pages": PAGES, "version": __version__,
            "csrf_token": request.scope.get("state", {}).get("csrf_token", ""),
            "refresh_ms": int(refresh * 1000), "auth": guard_auth,
            "params": dict(request.query_params), "root": request.scope.get("root_path", ""),
            **extra,
        }

    def page(name: str, template: str = "page.html") -> Callable[[Request], Response]:
        def render(request: Request) -> Response:
            return templates.TemplateResponse(request, template, context(request, name))
        return render

    # -- API: reads -----------------------------------------------------------------------
    def api_overview(request: Request) -> JSONResponse:
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

    def api_queues(request: Request) -> JSONResponse:
        offset, limit = _page_args(request)
        prefix = request.query_params.get("prefix") or None
        return JSONResponse({"items": client.job_queues(offset, limit, prefix),
                             "total": client.queue_count(prefix),
                             "offset": offset, "limit": limit})

    def api_pools(request: Request) -> JSONResponse:
        return JSONResponse({"items": client.worker_pools()})

    def api_busy(request: Request) -> JSONResponse:
        return JSONResponse({"items": client.busy_workers()})

    def _set_listing(kind: str) -> Callable[[Request], JSONResponse]:
        def listing(request: Request) -> JSONResponse:
            offset, limit = _page_args(request)
            fetch = {"scheduled": client.scheduled, "retry": client.retries,
                     "dead": client.dead}[kind]
            name = request.query_params.get("name") or None
            page: dict[str, Any] = dict(fetch(offset, limit, name))
            page["items"] = [_light(dict(i)) for i in page["items"]]
            return JSONResponse(page)
        return listing

    def api_history(request: Request) -> JSONResponse:
        try:
            return JSONResponse(client.history(request.query_params.get("window", "1h")))
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None

    def api_runtimes(request: Request) -> JSONResponse:
        try:
            items = client.runtimes(request.query_params.get("window", "1h"))
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        return JSONResponse({"items": items})

    def _search(kind: str) -> Callable[[Request], JSONResponse]:
        def search(request: Request) -> JSONResponse:
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
        return search

    def _search_action(kind: str, action: str) -> Callable[[Request], Any]:
        async def act(request: Request) -> JSONResponse:
            filters = _filters(await _json_body(request))
            if not filters.active:
                raise HTTPException(400, "give at least one filter (name, error, text, "
                                         "since, until); the plain retry/delete act on all")
            do = client.retry_matching if action == "retry" else client.delete_matching
            count = await run_in_threadpool(do, kind, filters)
            return JSONResponse({"count": count})
        return act

    def api_dead_job(request: Request) -> JSONResponse:
        job = client.dead_job(request.path_params["dead_id"])
        if job is None:
            raise HTTPException(404, "no such dead job")
        return JSONResponse(job)

    def api_job(request: Request) -> JSONResponse:
        return JSONResponse(client.job(request.path_params["job_id"]))

    async def api_job_events(request: Request) -> EventSourceResponse:
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

    def api_csrf(request: Request) -> JSONResponse:
        return JSONResponse({"csrf_token": request.scope.get("state", {}).get("csrf_token")})

    def api_health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": client.ping(), "version": __version__})

    # Behind the same guard as the API: job names and pool hosts are not public, and
    # Prometheus sends a bearer token or basic auth (see docs/operations.md).
    metrics_registry = registry_for(client)

    def metrics(request: Request) -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    # -- API: actions (POST, CSRF-checked by the guard) -------------------------------------
    async def api_pause(request: Request) -> JSONResponse:
        name = _str_field(await _json_body(request), "name")
        changed = await run_in_threadpool(client.pause, name)
        return JSONResponse({"name": name, "paused": True, "changed": changed})

    async def api_resume(request: Request) -> JSONResponse:
        name = _str_field(await _json_body(request), "name")
        changed = await run_in_threadpool(client.resume, name)
        return JSONResponse({"name": name, "paused": False, "changed": changed})

    async def api_rate_limit(request: Request) -> JSONResponse:
        body = await _json_body(request)
        name, rate = _str_field(body, "name"), body.get("rate_limit")
        if rate is not None and not isinstance(rate, str):
            raise HTTPException(400, "rate_limit must be a string like '20/s', or null")
        try:
            stored = await run_in_threadpool(client.set_rate_limit, name, rate or None)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        return JSONResponse({"name": name, "rate_limit": stored})

    async def api_stop(request: Request) -> JSONResponse:
        job_id = _str_field(await _json_body(request), "job_id")
        await run_in_threadpool(client.request_stop, job_id)
        return JSONResponse({"job_id": job_id, "stop_requested": True})

    async def api_scheduled_delete(request: Request) -> JSONResponse:
        job_id = _str_field(await _json_body(request), "id")
        deleted = await run_in_threadpool(client.delete_scheduled, job_id)
        if not deleted:
            raise HTTPException(404, "no such scheduled or retry job")
        return JSONResponse({"id": job_id, "deleted": True})

    async def api_dead_retry(request: Request) -> JSONResponse:
        ids = _ids_or_all(await _json_body(request))
        if ids is None:
            count = await run_in_threadpool(client.retry_all_dead)
            return JSONResponse({"count": count})
        done = [i for i in ids if await run_in_threadpool(client.retry_dead, i)]
        if not done:
            raise HTTPException(404, "no such dead job")
        return JSONResponse({"retried": done, "count": len(done)})

    async def api_dead_delete(request: Request) -> JSONResponse:
        ids = _ids_or_all(await _json_body(request))
        if ids is None:
            count = await run_in_threadpool(client.delete_all_dead)
            return JSONResponse({"count": count})
        done = [i for i in ids if await run_in_threadpool(client.delete_dead, i)]
        if not done:
            raise HTTPException(404, "no such dead job")
        return JSONResponse({"deleted": done, "count": len(done)})

    # -- periodic jobs ---------------------------------------------------------------------
    def api_periodic(request: Request) -> JSONResponse:
        return JSONResponse({"items": client.periodic(), "server_time": client.server_time()})

    def _periodic_action(kind: str) -> Callable[[Request], Any]:
        async def act(request: Request) -> JSONResponse:
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
        return act

    # -- pages ---------------------------------------------------------------------------
    def dead_detail(request: Request) -> Response:
        job = client.dead_job(request.path_params["dead_id"])
        if job is None:
            raise HTTPException(404, "no such dead job")
        return templates.TemplateResponse(request, "dead_job.html", context(
            request, "dead", job=job,
            args_text=json.dumps(job.get("args"), indent=1, default=repr),
            kwargs_text=json.dumps(job.get("kwargs"), indent=1, default=repr)))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": exc.detail}, exc.status_code)
        return templates.TemplateResponse(
            request, "error.html",
            context(request, "", status=exc.status_code, detail=exc.detail),
            status_code=exc.status_code)

    async def on_redis_error(request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": f"Redis unavailable: {exc}"}, 503)

    routes = [
        *(Route(path, page(name, PAGE_TEMPLATES.get(name, "page.html")))
          for name, path, _ in PAGES),
        # ":path": ids come from messages anyone could have written, "/" included.
        Route("/dead/{dead_id:path}", dead_detail),
        Route("/demo", page("demo", "demo.html")),
        Route("/api/overview", api_overview),
        Route("/api/queues", api_queues),
        Route("/api/queues/pause", api_pause, methods=["POST"]),
        Route("/api/queues/resume", api_resume, methods=["POST"]),
        Route("/api/queues/rate_limit", api_rate_limit, methods=["POST"]),
        Route("/api/pools", api_pools),
        Route("/api/busy", api_busy),
        Route("/api/busy/stop", api_stop, methods=["POST"]),
        Route("/api/scheduled", _set_listing("scheduled")),
        Route("/api/scheduled/delete", api_scheduled_delete, methods=["POST"]),
        Route("/api/retry", _set_listing("retry")),
        Route("/api/retry/delete", api_scheduled_delete, methods=["POST"]),
        Route("/api/dead", _set_listing("dead")),
        Route("/api/dead/retry", api_dead_retry, methods=["POST"]),
        Route("/api/dead/delete", api_dead_delete, methods=["POST"]),
        Route("/api/history", api_history),
        Route("/api/history/runtimes", api_runtimes),
        *(Route(f"/api/{kind}/search", _search(kind)) for kind in KINDS),
        *(Route(f"/api/{kind}/search/{action}", _search_action(kind, action), methods=["POST"])
          for kind in KINDS for action in ("retry", "delete")),
        Route("/api/dead/{dead_id:path}", api_dead_job),
        Route("/api/jobs/{job_id:path}/events", api_job_events),
        Route("/api/jobs/{job_id:path}", api_job),
        Route("/api/periodic", api_periodic),
        *(Route(f"/api/periodic/{kind}", _periodic_action(kind), methods=["POST"])
          for kind in ("pause", "resume", "run")),
        Route("/api/csrf", api_csrf),
        Route("/api/health", api_health),
        Route("/metrics", metrics),
        Mount("/static", app=StaticFiles(directory=str(_package.joinpath("static"))),
              name="static"),
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan,
        middleware=[Middleware(Guard, token=token, basic_auth=basic_auth,
                               allowed_hosts=allowed_hosts, allow_origins=allow_origins)],
        exception_handlers={HTTPException: on_http_error, redis.RedisError: on_redis_error})
    app.state.client = client
    app.state.sampler = sampler
    return app
