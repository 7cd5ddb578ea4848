"""Broker URL -> redis-py connection pool: the one place that knows how the plugin
reaches its Redis, directly or through Redis Sentinel.

Every connection of the plugin comes from here: the transport's channels, the worker
pool's own clients (heartbeat, reaper, requeuer, acks), :class:`~celery_ext.client.Client`
(CLI, dashboard) and the Flower integration. A caller hands over the connection
settings it has (host, password, TLS, timeouts: a dict of redis-py connection
keywords) and the :class:`SentinelConfig` of the URL, if any; it gets back a pool.
The transport's keywords first go through :func:`watch_replies`, so that each of its
connections notices when it goes silent (half-open) without mistaking a stalled
server for one (``store/probe.py``).

Sentinel URLs follow Kombu's ``sentinel://`` transport: each sentinel is one URL,
separated by ``;``; the master's name and the sentinels' own connection options are
transport options::

    broker_url = "celery-ext+sentinel://:secret@h1:26379/0;celery-ext+sentinel://h2:26379"
    broker_transport_options = {"master_name": "mymaster",
                                "sentinel_kwargs": {"password": "sentinel-secret"}}

The password (and user, and db) of the URL are the master's, as with Kombu; the
sentinels get only ``sentinel_kwargs`` (by default the socket timeouts), so a sentinel
with ``requirepass`` needs ``sentinel_kwargs={"password": ...}``.
``celery-exts+sentinel://`` speaks TLS to the master (``ssl`` in ``sentinel_kwargs``
for the sentinels). Which server is the master is redis-py's business
(``redis.sentinel``): a connection asks the sentinels at connect time, and a pool
whose master moved closes its idle connections. A connection that finds the old
master demoted (``READONLY``) is closed and the error becomes a ``ConnectionError``,
so every caller handles a failover as the connection cut it is.

Redis Cluster follows Kombu's conventions too: a seed URL (any reachable master; more
seeds ``;``-separated) plus a transport option::

    broker_url = "celery-ext://:secret@seed-host:6379/0"
    broker_transport_options = {"cluster": True}

A cluster has only db 0; TLS (``celery-exts://``) and the password work as on one node.
:func:`cluster_client` builds redis-py's :class:`~redis.cluster.RedisCluster`, which owns
slot routing, MOVED/ASK and topology refresh; job queues spread over the masters
(``keys.py``, docs/cluster.md). ``wait_replicas`` is refused on a cluster
(:data:`CLUSTER_NO_WAIT`).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis import sentinel as _sentinel
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException

from celery_ext.config import (
    DEFAULT_CONNECT_TIMEOUT,
    GREEN_MAX_CONNECTIONS,
    KEEPALIVE_COUNT,
    KEEPALIVE_IDLE,
    KEEPALIVE_INTERVAL,
    SENTINEL_SCHEME,
    TLS_SENTINEL_SCHEME,
    ConfigError,
    Settings,
    _bool,
    mask_url,
    redis_url,
)
from celery_ext.store.probe import probing

#: Transport option that says the URL's server is a seed node of a Redis Cluster.
CLUSTER_OPTION = "cluster"
#: Environment variable that overrides the option (compose files set it).
CLUSTER_ENV = "CELERY_EXT_CLUSTER"
#: Port of a cluster seed URL without one (Redis's default).
DEFAULT_CLUSTER_PORT = 6379
#: The one line a worker or producer configured for a cluster with ``wait_replicas`` stops with.
CLUSTER_NO_WAIT = (
    "celery_ext: wait_replicas is not available on a cluster in this version: WAIT has to "
    "follow each write on the connection of the master that ran it (drop wait_replicas, or "
    "use Sentinel for acknowledged replication)")
#: Port of a sentinel URL without one (Redis Sentinel's own default).
DEFAULT_SENTINEL_PORT = 26379
#: Transport options that describe the Sentinel setup (Kombu's names).
SENTINEL_OPTIONS = ("master_name", "min_other_sentinels", "sentinel_kwargs")


@dataclass(frozen=True)
class SentinelConfig:
    """Where the sentinels are and which master they watch, read from a broker URL."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    min_other_sentinels: int = 0
    #: Connection keywords for the sentinels themselves (None: the socket timeouts of
    #: the master's connections, redis-py's default).
    sentinel_kwargs: Mapping[str, Any] | None = field(default=None)

    @property
    def server_id(self) -> str:
        """Stable name of the server behind the sentinels (the master moves, this does not)."""
        return f"sentinel:{self.master_name}/{self.db}"


@dataclass(frozen=True)
class ClusterConfig:
    """The seed nodes and credentials of a Redis Cluster, read from a broker URL."""

    seeds: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    tls: bool = False
    #: Connection keywords from the URL's query (``ssl_cert_reqs``, timeouts, ...).
    query: Mapping[str, Any] = field(default_factory=dict)

    @property
    def server_id(self) -> str:
        """Stable name of the cluster (the first seed; masters move, the name does not)."""
        host, port = self.seeds[0]
        return f"cluster:{host}:{port}"


def cluster_config(urls: Iterable[str], options: Mapping[str, Any] | None = None,
                   environ: Mapping[str, str] | None = None) -> ClusterConfig | None:
    """The cluster setup of ``urls`` (each one URL, or ``;``-separated seeds) when the
    transport ``options`` say ``cluster`` (overridden by ``CELERY_EXT_CLUSTER``, as the
    settings are by theirs); None otherwise. Raises ConfigError (one line, password
    masked) for a db other than 0, a sentinel URL, or an unreadable port."""
    from redis.connection import parse_url

    environ = os.environ if environ is None else environ
    raw = environ.get(CLUSTER_ENV, (options or {}).get(CLUSTER_OPTION))
    try:
        wanted = _bool(raw) if raw is not None else False
    except ValueError:
        raise ConfigError(f"celery_ext: transport option {CLUSTER_OPTION!r} must be true or "
                          f"false, got {raw!r}") from None
    if not wanted:
        return None
    seeds: list[tuple[str, int]] = []
    username = password = None
    tls = False
    query: dict[str, Any] = {}
    for one in (u.strip() for entry in urls for u in entry.split(";")):
        if not one:
            continue
        shown = mask_url(one)
        if is_sentinel_url(one):
            raise ConfigError(f"celery_ext: broker URL {shown}: a cluster is reached through "
                              "its own nodes, not sentinels (drop 'cluster' or the +sentinel)")
        try:
            kwargs = parse_url(redis_url(one))
        except ValueError:
            raise ConfigError(f"celery_ext: broker URL {shown}: cannot read host:port (the "
                              "port must be a whole number 0-65535)") from None
        if int(kwargs.pop("db", 0) or 0) != 0:
            raise ConfigError(f"celery_ext: broker URL {shown}: a Redis Cluster has only db 0 "
                              "(end the URL with /0 or nothing)")
        seeds.append((str(kwargs.pop("host", "127.0.0.1")),
                      int(kwargs.pop("port", DEFAULT_CLUSTER_PORT))))
        tls = tls or kwargs.pop("connection_class", None) is redis.SSLConnection
        if password is None and kwargs.get("password"):
            username, password = kwargs.get("username"), kwargs["password"]
        kwargs.pop("username", None)
        kwargs.pop("password", None)
        query.update(kwargs)
    if not seeds:
        raise ConfigError("celery_ext: the 'cluster' transport option needs a broker URL "
                          "naming at least one node of the cluster")
    return ClusterConfig(seeds=tuple(seeds), username=username, password=password, tls=tls,
                         query=query)


def cluster_client(config: ClusterConfig, params: Mapping[str, Any] | None = None
                   ) -> RedisCluster:
    """redis-py's :class:`~redis.cluster.RedisCluster` for ``config``; ``params`` are
    connection keywords (timeouts, TLS options) applied to every node's connections.
    Slot routing, MOVED/ASK and a failover's new topology are redis-py's business.
    Raises ``redis.ConnectionError`` when no seed gives the slot map."""
    kwargs: dict[str, Any] = {k: v for k, v in (params or {}).items()
                              if k not in ("host", "port", "db", "path", "connection_class")}
    kwargs.update(config.query)
    if config.password is not None:
        kwargs["username"], kwargs["password"] = config.username, config.password
    if config.tls:
        kwargs["ssl"] = True
        kwargs.setdefault("ssl_cert_reqs", "required")  # secure by default, as on one node
    # The nodes a client of this process saw come after the seeds: a seed that died (a
    # failed-over master) leaves its replicas, promoted now, to answer a reconnect.
    seen = [n for n in _seen_nodes.get(config.seeds, ()) if n not in config.seeds]
    nodes = [ClusterNode(host, port) for host, port in (*config.seeds, *seen)]
    try:
        rc = RedisCluster(startup_nodes=nodes, **kwargs)
    except RedisClusterException as exc:
        # It asks the seeds for the slot map at once; no seed answering (or refusing
        # the password) is a connection failure to every caller, as on one node.
        raise redis.ConnectionError(str(exc)) from None
    _seen_nodes[config.seeds] = tuple((n.host, n.port) for n in rc.get_nodes())
    return rc


#: Cluster seeds -> every node (masters and replicas) the last client built from them saw.
_seen_nodes: dict[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]] = {}


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` (possibly ``;``-separated) names sentinels of ours."""
    return url.strip().startswith((f"{SENTINEL_SCHEME}://", f"{TLS_SENTINEL_SCHEME}://"))


def sentinel_config(urls: Iterable[str], options: Mapping[str, Any] | None = None
                    ) -> SentinelConfig | None:
    """The Sentinel setup of ``urls`` (each one URL, or ``;``-separated ones) and the
    transport ``options``; None when no URL is a sentinel URL of ours. Raises
    ConfigError (password masked) for a sentinel URL without ``master_name``."""
    options = options or {}
    found: list[tuple[str, int]] = []
    db: int | None = None
    username = password = None
    tls = False
    for one in (u.strip() for entry in urls for u in entry.split(";")):
        if not is_sentinel_url(one):
            continue
        parts = urlsplit(one)
        try:
            port = parts.port or DEFAULT_SENTINEL_PORT
        except ValueError:
            raise ConfigError(f"celery_ext: broker URL {mask_url(one)}: the port must be a "
                              "whole number 0-65535") from None
        found.append((parts.hostname or "127.0.0.1", port))
        tls = tls or parts.scheme == TLS_SENTINEL_SCHEME
        path = (parts.path or "").strip("/")
        if db is None and path:
            if not path.isdigit():
                raise ConfigError(f"celery_ext: broker URL {mask_url(one)}: the db (path) "
                                  f"must be a number, got {path!r}")
            db = int(path)
        if password is None and parts.password:
            username = unquote(parts.username) if parts.username else None
            password = unquote(parts.password)
    if not found:
        return None
    master_name = options.get("master_name")
    if not master_name:
        raise ConfigError(
            "celery_ext: a sentinel broker URL needs the master's name: "
            "broker_transport_options={'master_name': '<name in sentinel monitor>'}")
    kwargs = options.get("sentinel_kwargs")
    return SentinelConfig(
        sentinels=tuple(found), master_name=str(master_name), db=db or 0,
        username=username, password=password, tls=tls,
        min_other_sentinels=int(options.get("min_other_sentinels") or 0),
        sentinel_kwargs=dict(kwargs) if kwargs is not None else None)


def watch_replies(params: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """``params`` (redis-py connection keywords, as Kombu's channel builds them) with
    what makes a silent connection noticed, each unless the user set it: the socket
    timeout ``reply_timeout``, a connect timeout, TCP keep-alive, and a connection
    class whose reads probe the server once a reply is ``reply_probe_after`` overdue
    (``store/probe.py``). Unix sockets keep their class: they cannot go half-open."""
    if params.get("socket_timeout") is None:
        params["socket_timeout"] = settings.reply_timeout
    cls = params.get("connection_class", redis.Connection)
    if not (isinstance(cls, type) and issubclass(cls, redis.Connection)):
        return params
    if params.get("socket_connect_timeout") is None:
        params["socket_connect_timeout"] = min(DEFAULT_CONNECT_TIMEOUT, settings.reply_timeout)
    if not params.get("socket_keepalive"):
        params["socket_keepalive"] = True
        params["socket_keepalive_options"] = keepalive_options()
    after = settings.reply_probe_after
    if settings.wait_replicas:  # a WAIT for replicas is a reply that may take this long
        after += settings.wait_timeout_ms / 1000
    params["connection_class"] = probing(cls, after, settings.probe_timeout)
    return params


def green_sockets() -> bool:
    """Whether gevent's monkey-patching made this process's sockets cooperative (a
    ``-P gevent`` worker): its jobs are greenlets sharing the main process's clients."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_module_patched("socket"))


def green_connections(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with room for every greenlet that uses a client at once, under gevent
    (``GREEN_MAX_CONNECTIONS``); unchanged otherwise, and never lowered."""
    if green_sockets():
        params["max_connections"] = max(params.get("max_connections") or 0,
                                        GREEN_MAX_CONNECTIONS)
    return params


def keepalive_options() -> dict[int, int]:
    """TCP keep-alive timings (``socket_keepalive_options``) this system lets us set."""
    wanted = (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
              ("TCP_KEEPCNT", KEEPALIVE_COUNT))
    return {getattr(socket, name): value for name, value in wanted if hasattr(socket, name)}


def connections_for(params: dict[str, Any], sentinel: SentinelConfig | None = None
                    ) -> redis.ConnectionPool:
    """redis-py's connections (a ``ConnectionPool``) with the connection keywords
    ``params`` (redis-py's, as Kombu's channel builds them): to ``host:port``, or to
    whichever server the sentinels name master.

    For Sentinel, ``host``/``port`` are dropped, ``db`` and credentials come from the
    URL, and a ``connection_class`` in ``params`` must derive from
    ``SentinelManagedConnection`` (see :func:`sentinel_connection_class`)."""
    if sentinel is None:
        return redis.ConnectionPool(**params)
    return sentinel_manager(sentinel, params).master_for(
        sentinel.master_name, redis_class=redis.Redis).connection_pool


def sentinel_manager(sentinel: SentinelConfig, params: Mapping[str, Any]) -> _sentinel.Sentinel:
    """redis-py's :class:`~redis.sentinel.Sentinel` for ``sentinel``, whose masters get
    the connection keywords ``params``."""
    master = _master_kwargs(sentinel, params, drop=("host", "port", "path"))
    master.setdefault("connection_class", sentinel_connection_class(sentinel.tls))
    return _sentinel.Sentinel(list(sentinel.sentinels), **_manager_kwargs(sentinel), **master)


def _master_kwargs(sentinel: SentinelConfig, params: Mapping[str, Any],
                   drop: tuple[str, ...]) -> dict[str, Any]:
    """Connection keywords for the primary: ``params`` without the address (the
    sentinels give it), with the URL's db and credentials."""
    master = {k: v for k, v in params.items() if k not in drop}
    master["db"] = sentinel.db
    if sentinel.password is not None:
        master["username"], master["password"] = sentinel.username, sentinel.password
    return master


def _manager_kwargs(sentinel: SentinelConfig) -> dict[str, Any]:
    kwargs = sentinel.sentinel_kwargs
    return {"min_other_sentinels": sentinel.min_other_sentinels,
            "sentinel_kwargs": dict(kwargs) if kwargs is not None else None}


def sentinel_connection_class(tls: bool = False) -> type[redis.Connection]:
    """The connection class that asks the sentinels where the master is at connect
    time, and turns ``READONLY`` (a demoted master) into a ``ConnectionError``."""
    return _sentinel.SentinelManagedSSLConnection if tls else _sentinel.SentinelManagedConnection



def client_from_url(url: str, options: Mapping[str, Any] | None = None) -> Any:
    """A synchronous client for a broker URL of ours (or ``redis://``): for tools that
    have a URL and no Celery app (``Client.from_url``, the demo). With the ``cluster``
    option it is a :class:`~redis.cluster.RedisCluster`."""
    cluster = cluster_config([url], options)
    if cluster is not None:
        return cluster_client(cluster)
    config = sentinel_config([url], options)
    if config is None:
        return redis.Redis.from_url(redis_url(url))
    return redis.Redis(connection_pool=connections_for({}, config))


def async_client_from_url(url: str, options: Mapping[str, Any] | None = None,
                          **params: Any) -> Any:
    """A ``redis.asyncio`` client for a broker URL of ours (Flower's broker page);
    ``params`` are connection keywords (timeouts, TLS) for a direct URL and for the
    master behind sentinels. Close it with :func:`aclose_async_client`."""
    from redis import asyncio as aioredis
    from redis.asyncio import sentinel as asentinel
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

    cluster = cluster_config([url], options)
    if cluster is not None:  # seed nodes; redis-py routes every command by its slot
        kwargs = {k: v for k, v in params.items() if k not in ("host", "port", "db")}
        return AsyncRedisCluster(host=params.get("host"), port=params.get("port") or 6379,
                                 **kwargs)
    config = sentinel_config([url], options)
    if config is None:
        return aioredis.Redis(**params)
    master = _master_kwargs(config, params, drop=("host", "port", "ssl"))
    if config.tls or params.get("ssl"):
        master["connection_class"] = asentinel.SentinelManagedSSLConnection
    manager = asentinel.Sentinel(list(config.sentinels), **_manager_kwargs(config), **master)
    return manager.master_for(config.master_name, redis_class=aioredis.Redis)


async def aclose_async_client(client: Any) -> None:
    """Close an :func:`async_client_from_url` client and its sentinel connections."""
    await client.aclose()
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    if manager is not None:
        # Each sentinel's client, one by one: Sentinel.aclose() is redis-py 8's only.
        for sentinel in manager.sentinels:
            await sentinel.aclose()
