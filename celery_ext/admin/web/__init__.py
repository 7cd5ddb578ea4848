"""The celery-ext dashboard: ``celery -A proj ext web`` (needs ``pip install celery-ext[web]``).

:func:`create_app` builds the ASGI app around a :class:`celery_ext.client.Client`;
:func:`serve` runs it with uvicorn. See ``docs/dashboard.md``.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from celery_ext.admin.web.app import create_app
from celery_ext.admin.web.security import LOOPBACK_HOSTS, is_loopback

logger = logging.getLogger("celery_ext.admin.web")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5040

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "create_app", "serve"]


def _check_listen(host: str, shown: str, port: int) -> None:
    """Bind the address once, as uvicorn will, before announcing the URL: a port in use is
    one OSError line, not the dashboard's URL followed by uvicorn's ``[Errno 98]``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen on {shown}:{port}: "
                                     f"{exc.strerror or exc}") from None


def serve(client: Any, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
          token: str | None = None, basic_auth: str | None = None,
          allow_origins: tuple[str, ...] = (), log_level: str = "info",
          root_path: str = "", forwarded_allow_ips: str | None = None,
          allowed_hosts: tuple[str, ...] = ()) -> None:
    """Run the dashboard until interrupted.

    Bound to a loopback address, only loopback ``Host`` headers and ``allowed_hosts``
    are accepted (no DNS rebinding); bound elsewhere, only ``allowed_hosts`` if given,
    and without ``token``/``basic_auth`` a warning is logged. From the proxies in
    ``forwarded_allow_ips`` the ``X-Forwarded-Host`` is the one checked.
    """
    import uvicorn

    loopback = is_loopback(host)
    allowed = set(allowed_hosts) or None
    if loopback:
        allowed = (allowed or set()) | set(LOOPBACK_HOSTS) | {
            host, f"[{host}]" if ":" in host else host}
    if not loopback and not (token or basic_auth):
        logger.warning(
            "celery_ext web: listening on %s without authentication: anyone who can reach "
            "this address can see job arguments and retry or delete jobs. Pass --token or "
            "--basic-auth, or bind 127.0.0.1.", host)
    app = create_app(client, token=token, basic_auth=basic_auth, allowed_hosts=allowed,
                     allow_origins=allow_origins, forwarded_allow_ips=forwarded_allow_ips)
    shown = f"[{host}]" if ":" in host else host
    _check_listen(host, shown, port)
    logger.warning("celery_ext web: dashboard on http://%s:%d/ (%s)", shown, port,
                   "token or basic auth required" if token or basic_auth else "no authentication")
    uvicorn.run(app, host=host, port=port, log_level=log_level, root_path=root_path,
                access_log=log_level == "debug", proxy_headers=False)
