"""The dashboard's ASGI app: routes, middleware and state, put together.

The handlers are plain functions in ``pages.py`` (HTML) and ``api.py`` (the JSON API);
they find the client, the sampler, the templates and the settings in
``request.app.state``. The security layer (auth, CSRF, headers) is ``security.Guard``.
See ``docs/dashboard.md`` for the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from functools import partial

import redis
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from celery_ext.admin.client import Client
from celery_ext.admin.metrics import registry_for
from celery_ext.admin.search import KINDS
from celery_ext.admin.web import api, pages
from celery_ext.admin.web.api import PAGE_MAX
from celery_ext.admin.web.forwarded import ForwardedHeaders, parse_trusted
from celery_ext.admin.web.security import Guard
from celery_ext.admin.web.series import DEFAULT_HISTORY, DEFAULT_INTERVAL, Sampler

__all__ = ["PAGE_MAX", "REFRESH_SECONDS", "create_app"]

logger = logging.getLogger("celery_ext.admin.web")

#: Seconds between two page refreshes in the browser.
REFRESH_SECONDS = 2.0

POST = ["POST"]


def routes() -> list[BaseRoute]:
    """Every URL of the dashboard and its handler."""
    return [
        *(Route(path, partial(pages.page, name=name,
                              template=pages.PAGE_TEMPLATES.get(name, "page.html")))
          for name, path, _ in pages.PAGES),
        # ":path": ids come from messages anyone could have written, "/" included.
        Route("/dead/{dead_id:path}", pages.dead_detail),
        Route("/demo", partial(pages.page, name="demo", template="demo.html")),
        Route("/api/overview", api.overview),
        Route("/api/queues", api.queues),
        Route("/api/queues/pause", api.pause, methods=POST),
        Route("/api/queues/resume", api.resume, methods=POST),
        Route("/api/queues/rate_limit", api.rate_limit, methods=POST),
        Route("/api/pools", api.pools),
        Route("/api/busy", api.busy),
        Route("/api/chords", api.chords),
        Route("/api/busy/stop", api.stop, methods=POST),
        Route("/api/jobs/cancel", api.cancel, methods=POST),
        Route("/api/revoked", api.revoked),
        Route("/api/scheduled", partial(api.set_listing, kind="scheduled")),
        Route("/api/scheduled/delete", api.scheduled_delete, methods=POST),
        Route("/api/retry", partial(api.set_listing, kind="retry")),
        Route("/api/retry/delete", api.scheduled_delete, methods=POST),
        Route("/api/dead", partial(api.set_listing, kind="dead")),
        Route("/api/dead/retry", api.dead_retry, methods=POST),
        Route("/api/dead/delete", api.dead_delete, methods=POST),
        Route("/api/history", api.history),
        Route("/api/history/runtimes", api.runtimes),
        *(Route(f"/api/{kind}/search", partial(api.search, kind=kind)) for kind in KINDS),
        *(Route(f"/api/{kind}/search/{action}",
                partial(api.search_action, kind=kind, action=action), methods=POST)
          for kind in KINDS for action in ("retry", "delete")),
        Route("/api/dead/{dead_id:path}", api.dead_job),
        Route("/api/jobs/{job_id:path}/events", api.job_events),
        Route("/api/jobs/{job_id:path}", api.job),
        Route("/api/periodic", api.periodic),
        *(Route(f"/api/periodic/{kind}", partial(api.periodic_action, kind=kind),
                methods=POST) for kind in ("pause", "resume", "run")),
        Route("/api/periodic/entries", api.periodic_set, methods=POST),
        Route("/api/periodic/entries/{name:path}", api.periodic_remove, methods=["DELETE"]),
        Route("/api/csrf", api.csrf),
        Route("/api/health", api.health),
        Route("/metrics", api.metrics),
        Mount("/static", app=StaticFiles(directory=str(pages.PACKAGE.joinpath("static"))),
              name="static"),
    ]


async def _sample_forever(sampler: Sampler) -> None:
    """Sample the counters every interval for the overview plots; log an outage once,
    not every interval."""
    failing = False
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
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    task = asyncio.create_task(_sample_forever(app.state.sampler))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def create_app(client: Client, *, token: str | None = None, basic_auth: str | None = None,
               allowed_hosts: Iterable[str] | None = None, allow_origins: Iterable[str] = (),
               sample_interval: float = DEFAULT_INTERVAL, history: float = DEFAULT_HISTORY,
               refresh: float = REFRESH_SECONDS, forwarded_allow_ips: str | None = None
               ) -> Starlette:
    """Build the dashboard ASGI app around ``client``.

    ``token``/``basic_auth`` ("user:password") turn authentication on;
    ``allowed_hosts`` restricts the Host header (DNS rebinding); ``allow_origins``
    lets other sites read ``/api/jobs/...`` (the embeddable widget);
    ``forwarded_allow_ips`` names the proxies whose ``X-Forwarded-*`` headers are
    believed (``forwarded.ForwardedHeaders``), before the guard checks anything.
    """
    if basic_auth and ":" not in basic_auth:
        raise ValueError("basic auth must be given as USER:PASSWORD")
    proxies = []
    if forwarded_allow_ips:
        parse_trusted(forwarded_allow_ips)  # a bad entry fails here, not at the first request
        proxies.append(Middleware(ForwardedHeaders, trusted=forwarded_allow_ips))
    app = Starlette(
        routes=routes(), lifespan=_lifespan,
        middleware=[*proxies,
                    Middleware(Guard, token=token, basic_auth=basic_auth,
                               allowed_hosts=allowed_hosts, allow_origins=allow_origins)],
        exception_handlers={HTTPException: pages.http_error, redis.RedisError: api.redis_error})
    app.state.client = client
    app.state.sampler = Sampler(client, sample_interval, history)
    app.state.templates = pages.make_templates()
    app.state.metrics_registry = registry_for(client)
    app.state.refresh_ms = int(refresh * 1000)
    app.state.auth = bool(token or basic_auth)
    return app
