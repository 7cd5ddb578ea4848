"""The dashboard's HTML: page shells (Jinja2, autoescaped), a dead job's page, error pages.

Pages are thin shells: ``static/app.js`` fetches ``/api/...`` every couple of seconds
and renders with ``textContent`` only, so job data can never become markup. Handlers
find the client and the templates in ``request.app.state`` (set by ``create_app``).
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.templating import Jinja2Templates

from celery_ext import __version__

#: (name, path, title) of every page in the navigation bar.
PAGES = (
    ("overview", "/", "Overview"),
    ("queues", "/queues", "Job queues"),
    ("pools", "/pools", "Worker pools"),
    ("busy", "/busy", "Busy workers"),
    ("chords", "/chords", "Chords"),
    ("scheduled", "/scheduled", "Scheduled"),
    ("retry", "/retry", "Retry"),
    ("dead", "/dead", "Dead"),
    ("revoked", "/revoked", "Revoked"),
    ("periodic", "/periodic", "Periodic"),
)
#: Pages with a template of their own (the others use page.html).
PAGE_TEMPLATES = {"periodic": "periodic.html"}

PACKAGE = resources.files("celery_ext.admin.web")


def make_templates() -> Jinja2Templates:
    """The dashboard's templates, every one autoescaped whatever its extension."""
    templates = Jinja2Templates(directory=str(PACKAGE.joinpath("templates")))
    templates.env.autoescape = True
    return templates


def context(request: Request, name: str, **extra: Any) -> dict[str, Any]:
    """What every template gets: the page, the navigation, the CSRF token, the refresh
    interval, whether authentication is on, the query and the root path."""
    state = request.app.state
    return {
        "page": name, "pages": PAGES, "version": __version__,
        "csrf_token": request.scope.get("state", {}).get("csrf_token", ""),
        "refresh_ms": state.refresh_ms, "auth": state.auth,
        "params": dict(request.query_params), "root": request.scope.get("root_path", ""),
        **extra,
    }


def page(request: Request, *, name: str, template: str = "page.html") -> Response:
    """One page's shell (bound to its name and template in the route table)."""
    templates: Jinja2Templates = request.app.state.templates
    return templates.TemplateResponse(request, template, context(request, name))


def dead_detail(request: Request) -> Response:
    job = request.app.state.client.dead_job(request.path_params["dead_id"])
    if job is None:
        raise HTTPException(404, "no such dead job")
    templates: Jinja2Templates = request.app.state.templates
    return templates.TemplateResponse(request, "dead_job.html", context(
        request, "dead", job=job,
        args_text=json.dumps(job.get("args"), indent=1, default=repr),
        kwargs_text=json.dumps(job.get("kwargs"), indent=1, default=repr)))


async def http_error(request: Request, exc: Exception) -> Response:
    """An HTTP error: JSON under /api/, else the error page."""
    assert isinstance(exc, HTTPException)
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": exc.detail}, exc.status_code)
    templates: Jinja2Templates = request.app.state.templates
    return templates.TemplateResponse(
        request, "error.html", context(request, "", status=exc.status_code, detail=exc.detail),
        status_code=exc.status_code)
