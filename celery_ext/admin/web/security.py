"""Authentication, CSRF protection and security headers for the dashboard (one ASGI layer).

- **Auth** (optional): a bearer token (``Authorization: Bearer <token>``, or once
  ``?token=<token>`` in a browser, which sets an HttpOnly cookie and redirects) and/or
  HTTP basic auth. Static files are public: they hold no job data.
- **CSRF**: every state-changing request (anything but GET/HEAD/OPTIONS) must carry
  the per-session token of the ``celery_ext_csrf`` cookie (HttpOnly, SameSite=Strict)
  in an ``X-CSRF-Token`` header, and its ``Origin`` (or ``Sec-Fetch-Site``) must be
  this site. A request authenticated with the bearer token is exempt (browsers never
  send one on their own).
- **Host check** (DNS rebinding): with ``allowed_hosts`` set, other ``Host`` headers get 400.
- **Headers**: a strict Content-Security-Policy (no inline script at all), nosniff,
  no framing, no referrer.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Iterable
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, urlencode

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CSRF_COOKIE = "celery_ext_csrf"
CSRF_HEADER = "x-csrf-token"
AUTH_COOKIE = "celery_ext_auth"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)


def is_loopback(host: str) -> bool:
    """Is ``host`` (a bind address or host name) reachable only from this machine?"""
    host = host.strip("[]")
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def _same_secret(given: str, expected: str) -> bool:
    """Constant-time comparison of two texts as UTF-8 (``hmac.compare_digest`` refuses
    ``str`` with non-ASCII characters: a credential like "é" would be a 500, not a 401)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                               expected.encode("utf-8", "surrogateescape"))


def _token_digest(token: str) -> str:
    return hashlib.sha256(b"celery-ext-web:" + token.encode()).hexdigest()


def _cookie(name: str, value: str, secure: bool, max_age: int | None = None) -> str:
    parts = [f"{name}={value}", "Path=/", "HttpOnly", "SameSite=Strict"]
    if secure:
        parts.append("Secure")
    if max_age is not None:
        parts.append(f"Max-Age={max_age}")
    return "; ".join(parts)


def _host_name(host_header: str) -> str:
    if host_header.startswith("["):
        return host_header.split("]", 1)[0] + "]"
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


class Guard:
    """ASGI middleware enforcing the rules in the module docstring."""

    def __init__(self, app: ASGIApp, *, token: str | None = None,
                 basic_auth: str | None = None, allowed_hosts: Iterable[str] | None = None,
                 allow_origins: Iterable[str] = (), public_prefixes: Iterable[str] = ("/static/",)
                 ) -> None:
        self.app = app
        self.token = token or None
        self.token_digest = _token_digest(token) if token else None
        self.basic: tuple[str, str] | None = None
        if basic_auth:
            user, sep, password = basic_auth.partition(":")
            if not sep or not user:
                raise ValueError("basic auth must be given as USER:PASSWORD")
            self.basic = (user, password)
        self.allowed_hosts = {h.lower() for h in allowed_hosts} if allowed_hosts else None
        self.allow_origins = set(allow_origins)
        self.public_prefixes = tuple(public_prefixes)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.token or self.basic)

    # -- checks -----------------------------------------------------------------------------
    def _bearer_ok(self, headers: Headers) -> bool:
        if not self.token:
            return False
        scheme, _, value = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and _same_secret(value.strip(), self.token)

    def _basic_ok(self, headers: Headers) -> bool:
        if not self.basic:
            return False
        scheme, _, value = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            # ``value`` is the header decoded as Latin-1: raw UTF-8 bytes after "Basic"
            # arrive as non-ASCII characters, which b64decode refuses with a ValueError.
            user, _, password = base64.b64decode(value.strip()).decode().partition(":")
        except ValueError:  # binascii.Error and UnicodeDecodeError included
            return False
        return _same_secret(user, self.basic[0]) & _same_secret(password, self.basic[1])

    def _cookie_ok(self, cookies: dict[str, str]) -> bool:
        value = cookies.get(AUTH_COOKIE)
        return bool(self.token_digest and value
                    and _same_secret(value, self.token_digest))

    def _same_origin(self, scope: Scope, headers: Headers) -> bool:
        origin = headers.get("origin")
        if origin is not None:
            expected = f"{scope.get('scheme', 'http')}://{headers.get('host', '')}"
            return origin.lower() == expected.lower()
        site = headers.get("sec-fetch-site")
        return site is None or site in ("same-origin", "none")

    # -- ASGI --------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path: str = scope["path"]
        method: str = scope["method"]
        secure = scope.get("scheme") == "https"
        cookies = _parse_cookies(headers.get("cookie", ""))

        if self.allowed_hosts is not None:
            host = _host_name(headers.get("host", "")).lower()
            if host not in self.allowed_hosts:
                await PlainTextResponse("unknown Host header", 400)(scope, receive, send)
                return

        bearer = self._bearer_ok(headers)
        public = path.startswith(self.public_prefixes)
        extra_cookies: list[str] = []
        if self.auth_enabled and not public and not (
                bearer or self._basic_ok(headers) or self._cookie_ok(cookies)):
            query = dict(parse_qsl(scope.get("query_string", b"").decode()))
            given = query.pop("token", None)
            if (given and self.token and method == "GET"
                    and _same_secret(given, self.token)):
                target = path + ("?" + urlencode(query) if query else "")
                response: Response = RedirectResponse(target, status_code=303)
                response.headers.append(
                    "set-cookie", _cookie(AUTH_COOKIE, self.token_digest or "", secure))
                await response(scope, receive, send)
                return
            response = JSONResponse({"error": "authentication required"}, 401)
            if self.basic:
                response.headers["www-authenticate"] = 'Basic realm="celery-ext"'
            await response(scope, receive, send)
            return

        csrf = cookies.get(CSRF_COOKIE)
        if not csrf or len(csrf) < 20:
            csrf = secrets.token_urlsafe(32)
            extra_cookies.append(_cookie(CSRF_COOKIE, csrf, secure))
        scope.setdefault("state", {})["csrf_token"] = csrf

        if method not in SAFE_METHODS and not bearer:
            sent = headers.get(CSRF_HEADER, "")
            if not self._same_origin(scope, headers):
                await JSONResponse({"error": "cross-origin request refused"}, 403)(
                    scope, receive, send)
                return
            if not sent or not cookies.get(CSRF_COOKIE) or not _same_secret(
                    sent, cookies[CSRF_COOKIE]):
                await JSONResponse({"error": "missing or wrong CSRF token"}, 403)(
                    scope, receive, send)
                return

        cors_origin = headers.get("origin")
        cors = (cors_origin is not None and method in SAFE_METHODS
                and path.startswith("/api/jobs/")
                and ("*" in self.allow_origins or cors_origin in self.allow_origins))

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                out = MutableHeaders(scope=message)
                for value in extra_cookies:
                    out.append("set-cookie", value)
                out.setdefault("content-security-policy", CONTENT_SECURITY_POLICY)
                out.setdefault("x-content-type-options", "nosniff")
                out.setdefault("x-frame-options", "DENY")
                out.setdefault("referrer-policy", "no-referrer")
                if cors and cors_origin is not None:
                    out["access-control-allow-origin"] = cors_origin
                    out["vary"] = "Origin"
            await send(message)

        await self.app(scope, receive, send_wrapper)


def _parse_cookies(header: str) -> dict[str, str]:
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(header)
    except Exception:
        return {}
    return {k: m.value for k, m in jar.items()}


def describe(guard: Any) -> str:
    """How the dashboard is protected, for the startup log line."""
    parts = []
    if guard.token:
        parts.append("bearer token")
    if guard.basic:
        parts.append("basic auth")
    return " + ".join(parts) or "no authentication"
