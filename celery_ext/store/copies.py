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
    """The job queues of ``keys``' namespace, sorted: the registry, the weighted queues
    and, on a cluster, the home hint of queues holding jobs (a push that finds its list
    empty adds the queue there, so a queue forgotten from the registry while a producer
    still has it cached is known again with its first job). One round trip. Nothing is
    forgotten here (see :func:`forget_queues`)."""
    home = keys.home
    with client.pipeline(transaction=False) as pipe:
        pipe.smembers(home.queues)
        pipe.hkeys(home.weights)
        if keys.cluster:
            pipe.smembers(home.ready)
        found = pipe.execute()
    return sorted({bytes_to_str(n) for names in found for n in names})


def _copy_in_use(pipe: Any, keys: Keys, queue: str) -> None:
    """Queue the reads that tell whether a queue's copy still holds anything a pass over
    the known queues must visit (cluster): jobs scheduled, retrying or dead, finished
    entries of its job index not yet trimmed, pools that joined it or own its jobs, a
    job queue's copy re-registering it; and the home weight."""
    c = keys.of(queue)
    pipe.exists(c.scheduled, c.retry, c.dead, c.job_index_done, c.pools, c.inflight_pools)
    pipe.sismember(c.queues, queue)
    pipe.hexists(keys.home.weights, queue)


def forget_queues(client: Any, keys: Keys, names: Sequence[str]) -> set[str]:
    """Cluster: forget from the home copy the job queues whose copy's ``queue_info``
    just forgot them (list gone, nothing configures or uses it, no live pool consumes
    it), unless the copy still holds records the reaper, the requeuer or a view must
    find: remove them from the registry with their fields of the home ``stats`` and
    ``runtime`` hashes (where the workers' counters go). Returns the names forgotten.

    Every writer adds a queue to the home registry after writing its copy (a pool's
    join, a scheduled job) or to the home ``ready`` hint after the push, so the copy is
    read again after the removal: what was written since is seen, and the name put
    back. On one node ``queue_info.lua`` does all of this itself: returns nothing."""
    if not keys.cluster or not names:
        return set()
    home = keys.home

    def unused() -> list[str]:
        with client.pipeline(transaction=False) as pipe:  # by master on a cluster
            for name in names:
                _copy_in_use(pipe, keys, name)
            flat = pipe.execute()
        return [n for i, n in enumerate(names) if not any(flat[3 * i:3 * i + 3])]

    gone = unused()
    if not gone:
        return set()
    with client.pipeline(transaction=False) as pipe:
        pipe.srem(home.queues, *gone)
        for name in gone:
            stats, runtime = Keys.queue_fields(name)
            pipe.hdel(home.stats, *stats).hdel(home.runtime, *runtime)
        pipe.execute()
    back = set(gone).difference(unused())
    if back:
        client.sadd(home.queues, *sorted(back))
    return set(gone) - back


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

