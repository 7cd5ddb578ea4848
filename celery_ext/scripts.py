"""Loads the Lua scripts in ``scripts/*.lua`` once and calls them by SHA.

Each ``.lua`` file starts with a header naming every ``KEYS[i]`` and ``ARGV[i]``;
every key a script touches is passed in ``KEYS`` (Redis Cluster rule).

The scripts by which a pool keeps the jobs it owns safe (fetch, ack, requeue, dead,
recover, heartbeat, deregister, unique_release, and bind for a worker's queue
bindings) start with ``#!lua flags=allow-oom``:
when Redis reaches ``maxmemory`` a pool must still drain, finish, return and
dead-letter jobs and stay alive (each is atomic: refused whole or run whole, never
stopped half-way at its first growing write). So does queue_info, which only reads
and removes: the dashboard and the CLI must work on a full Redis. New work (enqueue,
schedule, promote) is refused, so memory cannot grow without bound. Flags need
Redis 7.0+ / Valkey.

A line ``-- @include <fragment>`` in a script is replaced by ``scripts/_<fragment>.lua``:
the job index's helpers (``_job_index.lua``) are shared by every script that moves a job.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script

SCRIPT_NAMES = (
    "enqueue", "fetch", "ack", "requeue", "heartbeat", "deregister", "dead", "recover",
    "checkin", "busy", "schedule", "promote", "enqueue_unique", "unique_release", "dead_retry",
    "bind", "stats", "forget", "queue_info", "history", "search", "periodic_run",
    "periodic_sync", "purge",
)


#: A line ``-- @include <name>`` in a script is replaced by ``scripts/_<name>.lua``: the
#: helpers several scripts share (``_job_index.lua``, ``_fair.lua``, ``_priority.lua``)
#: have one text.
INCLUDE = "-- @include "


@cache
def source(name: str) -> str:
    """The text of ``scripts/<name>.lua`` shipped with the package, its includes pasted."""
    text = resources.files("celery_ext").joinpath("scripts", f"{name}.lua").read_text("utf-8")
    return "".join(source("_" + line[len(INCLUDE):].strip()) if line.startswith(INCLUDE)
                   else line for line in text.splitlines(keepends=True))


@cache
def sha(name: str) -> str:
    """SHA1 of a script, as EVALSHA wants it (computed locally, no round trip)."""
    import hashlib

    return hashlib.sha1(source(name).encode("utf-8")).hexdigest()


class Scripts:
    """The plugin's scripts bound to one client; NOSCRIPT is handled by redis-py."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._scripts: dict[str, Script] = {
            name: client.register_script(source(name)) for name in SCRIPT_NAMES
        }

    def __call__(self, name: str, keys: list[str], args: list[Any],
                 client: Any = None) -> Any:
        return self._scripts[name](keys=keys, args=args, client=client or self._client)

    def load_all(self, client: redis.Redis | None = None) -> None:
        """Load every script into the server's cache (after a restart flushed it)."""
        target = client or self._client
        if isinstance(target, RedisCluster):  # no SCRIPT LOAD in a cluster pipeline
            for name in SCRIPT_NAMES:
                target.script_load(source(name))  # (to every master)
            return
        with target.pipeline(transaction=False) as pipe:  # one round trip for all
            for name in SCRIPT_NAMES:
                pipe.script_load(source(name))
            pipe.execute()
