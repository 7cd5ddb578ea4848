"""The request as the browser made it, when a trusted proxy relays it (one ASGI layer).

Behind a TLS-terminating proxy the dashboard sees ``http`` and the proxy's ``Host``, so the
guard's Origin check (``https://jobs.example.com`` against ``http://127.0.0.1:5040``) would
refuse every action. From peers in ``trusted`` (uvicorn's ``--forwarded-allow-ips``: IPs,
networks, or ``*``) this layer takes ``X-Forwarded-Proto`` as the scheme,
``X-Forwarded-Host`` as the ``Host`` header (so the guard's Origin and Host checks see the
public name) and ``X-Forwarded-For`` as the client. From any other peer the headers are left
unread: anyone can send them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

SCHEMES = frozenset({"http", "https"})

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_trusted(value: str | Iterable[str]) -> tuple[bool, list[Network], set[str]]:
    """``"127.0.0.1, 10.0.0.0/8"`` -> (any peer, networks, other literals such as a unix
    socket path); a malformed entry is a ValueError naming it."""
    items = value.split(",") if isinstance(value, str) else list(value)
    anyone, networks, literals = False, [], set()
    for item in (i.strip() for i in items):
        if not item:
            continue
        if item == "*":
            anyone = True
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            if item[0].isdigit() or ":" in item:
                raise ValueError(f"forwarded-allow-ips: {item!r} is not an IP address or "
                                 f"network") from None
            literals.add(item)
    return anyone, networks, literals


def _last(value: bytes) -> str:
    """The last entry of a comma-separated header: the one the nearest proxy added."""
    return value.decode("latin-1").rsplit(",", 1)[-1].strip()


class ForwardedHeaders:
    """ASGI middleware doing what the module docstring says."""

    def __init__(self, app: ASGIApp, trusted: str | Iterable[str]) -> None:
        self.app = app
        self.anyone, self.networks, self.literals = parse_trusted(trusted)

    def trusts(self, peer: str | None) -> bool:
        if self.anyone:
            return True
        if not peer:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return peer in self.literals
        return any(address in network for network in self.networks)

    def _client(self, forwarded_for: str) -> tuple[str, int] | None:
        """The rightmost address not a trusted proxy: the client the first trusted proxy
        saw (the entries left of it are the client's own word)."""
        hops = [h.strip() for h in forwarded_for.split(",") if h.strip()]
        for hop in reversed(hops):
            if not self.trusts(hop):
                return hop, 0
        return (hops[0], 0) if hops else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        peer = scope.get("client")
        if not self.trusts(peer[0] if peer else None):
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = []
        proto = host = None
        forwarded_for: list[bytes] = []
        for name, value in scope["headers"]:
            if name == b"x-forwarded-proto":
                proto = _last(value).lower()
            elif name == b"x-forwarded-host":
                host = _last(value)
            elif name == b"x-forwarded-for":
                forwarded_for.append(value)
            if name != b"host":
                headers.append((name, value))
        scope = dict(scope)
        if proto in SCHEMES:
            scope["scheme"] = proto if scope["type"] == "http" else proto.replace("http", "ws")
        if host:
            scope["headers"] = [(b"host", host.encode("latin-1")), *headers]
        if forwarded_for:
            client = self._client(b",".join(forwarded_for).decode("latin-1"))
            if client:
                scope["client"] = client
        await self.app(scope, receive, send)
