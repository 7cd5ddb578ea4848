"""Which copies of a namespace's layout there are, and how to read or act on them all.

On one node the whole layout is one copy, so a namespace-wide view is one read of
it. On a Redis Cluster every job queue has a copy of its own (``Keys.of(queue)``,
see keys.py and docs/cluster.md) and the namespace keeps the home copy: a view of
per-queue state (dead set, scheduled set, counters, limits) reads the home copy and
every known queue's copy and merges. The known job queues are the registry
(``{ns}:queues``, written by producers and pools) and the queues that have a weight
(``{ns}:weights``, written by pools): a queue a pool consumes is known even before
its first job.

On one node nothing here adds a round trip: :func:`copies` is the one copy, without
asking Redis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis
from kombu.utils.encoding import bytes_to_str
from redis.cluster import RedisCluster

from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts, sha


def known_queues(client: Any, keys: Keys) -> list[str]:
    """The job queues of ``keys``' namespace, sorted: the registry and the weighted
    queues (one round trip). Nothing is forgotten here (see ``queue_info.lua``)."""
    home = keys.home
    with client.pipeline(transaction=False) as pipe:
        pipe.smembers(home.queues)
        pipe.hkeys(home.weights)
        names, weighted = pipe.execute()
    return sorted({bytes_to_str(n) for n in names} | {bytes_to_str(w) for w in weighted})


def queue_copies(client: Any, keys: Keys) -> dict[Keys, list[str]]:
    """Every known job queue by the copy holding it (``Keys.groups``): one group on
    one node, one per queue on a cluster."""
    return keys.groups(known_queues(client, keys))


def copies(client: Any, keys: Keys) -> list[Keys]:
    """The copies a namespace-wide view reads: the home copy, then every known
    queue's. On one node the one copy, without a round trip."""
    home = keys.home
    if not keys.cluster:
        return [home]
    return [home, *(k for k in queue_copies(client, keys) if k != home)]


def queue_of(copy: Keys) -> str:
    """The job queue whose copy ``copy`` is (its tag is ``<namespace>:<queue>``)."""
    return copy.tag[len(copy.namespace) + 1:]


def per_copy(client: Any, parts: Sequence[Keys],
             read: Callable[[Any, Keys], object]) -> list[list[Any]]:
    """``read(pipe, copy)`` queues the same commands for each copy; returns each copy's
    replies. One pipeline: a cluster's groups the commands by master, one round trip
    to each master visited."""
    counts: list[int] = []
    with client.pipeline(transaction=False) as pipe:
        for copy in parts:
            before = len(pipe)
            read(pipe, copy)
            counts.append(len(pipe) - before)
        replies = pipe.execute() if parts else []
    out, at = [], 0
    for n in counts:
        out.append(list(replies[at:at + n]))
        at += n
    return out


def set_counts(client: Any, keys: Keys) -> tuple[int, int, int]:
    """Sizes of the scheduled, retry and dead sets, summed over the copies."""
    replies = per_copy(client, copies(client, keys), lambda pipe, copy: (
        pipe.zcard(copy.scheduled), pipe.zcard(copy.retry), pipe.zcard(copy.dead)))
    return (sum(int(r[0]) for r in replies), sum(int(r[1]) for r in replies),
            sum(int(r[2]) for r in replies))


def run_scripts(client: Any, scripts: Scripts, calls: Sequence[tuple[str, list[str], list[Any]]]
                ) -> list[Any]:
    """Run several script calls (name, KEYS, ARGV), each on the keys of one copy, in
    one pipeline per master (:func:`evalsha_by_master`); a server that lost its scripts
    gets them loaded (on every master) and those calls are sent once more. An error
    reply of a script is raised, as a single call would raise it."""
    if not calls:
        return []
    if len(calls) == 1:
        return [scripts(*calls[0])]
    replies = evalsha_by_master(client, calls)
    again = [i for i, r in enumerate(replies) if isinstance(r, redis.exceptions.NoScriptError)]
    if again:
        scripts.load_all(client)  # (on every master of a cluster)
        for i, reply in zip(again, evalsha_by_master(client, [calls[i] for i in again]),
                            strict=True):
            replies[i] = reply
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


#: Replies saying a call did not run because its slot moved or is moving.
_REDIRECTED = (redis.exceptions.MovedError, redis.exceptions.AskError,
               redis.exceptions.TryAgainError)


def evalsha_by_master(client: Any, calls: Sequence[tuple[str, list[str], list[Any]]]
                      ) -> list[Any]:
    """Each call (script name, KEYS, ARGV) on the master of its keys' slot, in one plain
    pipeline per master: one round trip per master. (redis-py's cluster pipeline first
    asks a node for the keys of every ``EVALSHA`` it carries, ``COMMAND GETKEYS``: one
    more round trip per call.) Replies in call order, an error reply in its place. A
    call refused because its slot moved (MOVED, ASK) or is moving (TRYAGAIN) did not
    run: it is sent again through the cluster client, which follows the redirection
    and refreshes its slot map. On one node: one pipeline."""
    if not calls:
        return []
    if not isinstance(client, RedisCluster):
        with client.pipeline(transaction=False) as pipe:
            for name, keys, args in calls:
                pipe.execute_command("EVALSHA", sha(name), len(keys), *keys, *args)
            return list(pipe.execute(raise_on_error=False))
    by_node: dict[str, tuple[Any, list[int]]] = {}
    for i, (_, keys, _) in enumerate(calls):
        node = client.get_node_from_key(keys[0])
        by_node.setdefault(node.name, (node, []))[1].append(i)
    replies: list[Any] = [None] * len(calls)
    for node, indexes in by_node.values():
        with client.get_redis_connection(node).pipeline(transaction=False) as pipe:
            for i in indexes:
                name, keys, args = calls[i]
                pipe.execute_command("EVALSHA", sha(name), len(keys), *keys, *args)
            for i, reply in zip(indexes, pipe.execute(raise_on_error=False), strict=True):
                replies[i] = reply
    for i, reply in enumerate(replies):
        if isinstance(reply, _REDIRECTED):
            name, keys, args = calls[i]
            try:
                replies[i] = client.execute_command("EVALSHA", sha(name), len(keys), *keys,
                                                    *args)
            except redis.exceptions.ResponseError as exc:
                replies[i] = exc
    return replies

