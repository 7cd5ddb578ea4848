"""The interface every topology implements (one node, Sentinel, cluster): what a channel
asks of wherever its Redis is."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery_ext.store.keys import Keys

if TYPE_CHECKING:
    from celery_ext.transport.channel import Channel


class Topology(ABC):
    """What differs between one node, Sentinel and a cluster, for one channel (made
    with the channel, which it serves alone)."""

    #: Whether the channel speaks TLS whatever its URL's scheme says.
    tls = False

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    @abstractmethod
    def prepare(self) -> None:
        """Set what Kombu's channel reads while it is made (called before its
        ``__init__``)."""

    @property
    @abstractmethod
    def server_id(self) -> str:
        """Which server the channel talks to (stable across a failover)."""

    @abstractmethod
    def connections(self, asynchronous: bool, kombu: Callable[[bool], Any]) -> Any:
        """The redis-py connection pool of the channel's own connections (the fetch
        signal, wake-ups, fanout): Kombu's ``_get_pool``."""

    @abstractmethod
    def create_client(self, asynchronous: bool, kombu: Callable[[bool], Any]) -> Any:
        """Kombu's ``_create_client``: a new client of the channel."""

    @abstractmethod
    def client(self) -> Any:
        """The channel's shared client for commands (``conn_or_acquire``)."""

    @abstractmethod
    def scripts_client(self) -> Any:
        """The client the channel's scripts are bound to."""

    @abstractmethod
    def new_client(self) -> Any:
        """A client on connections of its own, with the channel's connection settings:
        for parts that outlive channels (the worker pool, observers, admin clients)."""

    @abstractmethod
    def publish_connections(self) -> Callable[[], Any] | None:
        """What gives the enqueuer the redis-py pool it keeps one connection of, or
        None: every publish goes through the shared client."""

    @abstractmethod
    def refresh_bindings(self, queues: Any, kombu: Callable[[Any], None]) -> None:
        """Kombu's periodic refresh of expiring bindings."""

    @abstractmethod
    def copy_of(self, tag: str, queue: str | None = None) -> Keys:
        """The copy of the layout whose records hold the tracked job ``tag`` (``queue``'s
        copy when the job is no longer in a record)."""

    @abstractmethod
    def fetched(self, tag: str, queue: str) -> None:
        """A tracked job of ``queue`` came in a fetch reply."""

    @abstractmethod
    def fetch(self, client: Any, pool_id: str, queues: list[str], flags: str) -> Any:
        """Run one fetch now, through ``client``, and return its reply as ``fetch.lua``
        gives it: status, jobs, empties, blocked, waits."""

    @abstractmethod
    def send_fetch(self, conn: Any, pool_id: str, queues: list[str], flags: str,
                   lost: Callable[[], None]) -> None:
        """Put a fetch's reply on the channel's own connection ``conn``, to be read by
        :meth:`read_fetch` when it is readable. ``lost``: the fetch failed before
        anything was sent on ``conn`` (no reply will come)."""

    @abstractmethod
    def read_fetch(self, conn: Any, **options: Any) -> Any:
        """Read the reply :meth:`send_fetch` put on ``conn``."""

    @abstractmethod
    def emptied(self, queues: list[str]) -> list[str]:
        """A fetch found ``queues`` empty; returns those that hold jobs after all."""

    @abstractmethod
    def recheck(self, queues: Callable[[], list[str]]) -> list[str]:
        """Before a read of the ready set: those of the consumed ``queues`` whose lists
        are seen to hold jobs, when it is time to look at the lists themselves."""

    def declare(self, client: Any, lists: list[list[str]],
                bindings: list[tuple[str, str, list[str]]]) -> list[int]:
        """Many job queues declared at once (``JobQueues.predeclared``): the size of each
        queue whose ``lists`` are given (their lengths, one per priority level, summed;
        only queues whose count is read) and Kombu's binding
        tables written (table, permanent set, members), in one round trip. Here a
        pipeline, which a cluster client splits by slot; one node runs a script."""
        with client.pipeline(transaction=False) as pipe:
            for keys in lists:
                for key in keys:
                    pipe.llen(key)
            for table, permanent, members in bindings:
                pipe.sadd(table, *members)
                pipe.sadd(permanent, *members)
            replies = pipe.execute()
        sizes, at = [], 0
        for keys in lists:
            sizes.append(sum(int(n) for n in replies[at:at + len(keys)]))
            at += len(keys)
        return sizes
