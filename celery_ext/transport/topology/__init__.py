"""Where a channel's Redis is: one node, the master behind Sentinel, or a Redis Cluster.

The topology is chosen once, when the channel is made (:func:`topology_for`), as Kombu
chooses its Sentinel channel by URL scheme; everything that differs between the three
is one method of the interface :class:`~.base.Topology`, implemented by
:class:`~.node.OneNode`, :class:`~.sentinel.Sentinel` and :class:`~.cluster.Cluster`:

* the channel's connections (redis-py's pool behind Kombu's ``_get_pool``), its clients
  (the shared one behind ``conn_or_acquire``, the one its scripts are bound to, one of
  its own for the worker pool), the connections the enqueuer keeps, and the server's name;
* on a cluster, the layout is copied per job queue (``store/keys.py``): which copy holds
  a tracked job (``copy_of``, ``fetched``), a fetch that runs one script per copy of its
  candidates on several masters (and hands its reply to the channel's own connection
  with a PING), the home ``ready`` hint kept true (``emptied``, ``recheck``), and
  Kombu's bindings refresh without its pipeline.

A method that reproduces Kombu's own behaviour on one node gets Kombu's method as
``kombu`` and calls it, so the one-node channel stays Kombu's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from celery_ext.config import TLS_SCHEME, ConfigError, Settings
from celery_ext.store.connections import CLUSTER_NO_WAIT, cluster_config, sentinel_config
from celery_ext.transport.topology.base import Topology
from celery_ext.transport.topology.cluster import Cluster
from celery_ext.transport.topology.node import OneNode
from celery_ext.transport.topology.sentinel import Sentinel

if TYPE_CHECKING:
    from celery_ext.transport.channel import Channel


def topology_for(channel: Channel, conninfo: Any) -> Topology:
    """The topology of a channel being made on the Kombu connection ``conninfo``: a
    cluster when the transport option ``cluster`` says so, Sentinel for a sentinel URL
    of ours, else one node. Raises ConfigError for a setup that cannot work."""
    options = conninfo.transport_options
    sentinel = sentinel_config(urls_of(conninfo), options)
    cluster = cluster_config(seed_urls(conninfo), options)
    if cluster is not None:
        return Cluster(channel, cluster)
    if sentinel is not None:
        return Sentinel(channel, conninfo, sentinel)
    return OneNode(channel, conninfo)


def refuse_unsupported(conninfo: Any, settings: Settings) -> None:
    """Stop a transport (before any channel) whose settings its topology cannot keep:
    ``wait_replicas`` on a cluster."""
    if cluster_config(seed_urls(conninfo), conninfo.transport_options) \
            and settings.wait_replicas:
        raise ConfigError(CLUSTER_NO_WAIT)


def urls_of(conninfo: Any) -> list[str]:
    """Every URL of a Kombu connection. Kombu splits ``celery-ext+sentinel://h1`` into
    transport ``celery-ext`` and host ``sentinel://h1``; the full list is in ``alt``."""
    if conninfo.alt:
        return [u for u in conninfo.alt if isinstance(u, str)]
    prefix = getattr(conninfo, "uri_prefix", None)
    host = conninfo.hostname or ""
    return [f"{prefix}+{host}" if prefix else host]


def seed_urls(conninfo: Any) -> list[str]:
    """The URLs of a Kombu connection as a cluster's seeds: every ``;``-separated one,
    or the one URL rebuilt with its credentials (``as_uri`` would build a transport)."""
    if conninfo.alt:
        return [u for u in conninfo.alt if isinstance(u, str)]
    scheme = "rediss" if conninfo.transport_cls == TLS_SCHEME else "redis"
    auth = ""
    if conninfo.password:
        auth = f"{quote(conninfo.userid or '', safe='')}:{quote(conninfo.password, safe='')}@"
    db = (conninfo.virtual_host or "").strip("/")
    return [f"{scheme}://{auth}{conninfo.hostname}:{conninfo.port or 6379}/{db}"]


__all__ = ["Cluster", "OneNode", "Sentinel", "Topology", "refuse_unsupported",
           "seed_urls", "topology_for", "urls_of"]
