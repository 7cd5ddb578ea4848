"""Loads the Lua scripts in ``lua/*.lua`` once and calls them by SHA.

Each ``.lua`` file starts with a header naming every ``KEYS[i]`` and ``ARGV[i]``;
every key a script touches is passed in ``KEYS`` (Redis Cluster rule).

The scripts by which a pool keeps the jobs it owns safe (fetch, ack, requeue, dead,
recover, heartbeat, deregister, unique_release, and bind for a worker's queue
bindings) start with ``#!lua flags=allow-oom``:
when Redis reaches ``maxmemory`` a pool must still drain, finish, return and
dead-letter jobs and stay alive (each is atomic: refused whole or run whole, never
stopped half-way at its first growing write). So do queue_info, which only reads
and removes: the dashboard and the CLI must work on a full Redis, and job_index_trim,
which frees memory. New work (enqueue, schedule, promote) is refused, so memory
cannot grow without bound. Flags need Redis 7.0+ / Valkey.

A line ``-- @include <fragment>`` in a script is replaced by ``lua/include/<fragment>.lua``:
the job index's helpers (``include/job_index.lua``) are shared by every script that moves a job.
Only the helpers a script calls are pasted (:func:`used_helpers`): Lua creates every
``local function`` of a script at each call, and the unused ones of a fragment cost a
script like ``enqueue`` about a fifth of its time inside Redis.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from typing import Any

import hiredis
import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script

SCRIPT_NAMES = (
    "enqueue", "fetch", "ack", "requeue", "heartbeat", "deregister", "dead", "recover",
    "checkin", "busy", "schedule", "promote", "enqueue_unique", "unique_release", "dead_retry",
    "bind", "forget", "queue_info", "history", "search", "periodic_run",
    "periodic_sync", "periodic_lease", "periodic_outcome", "purge", "job_index_trim",
    "chord_size", "chord_part", "chord_done", "revoke", "cursor", "declare", "throttle",
    "job_where",
)


#: A line ``-- @include <name>`` in a script is replaced by ``lua/include/<name>.lua``:
#: the helpers several scripts share (``clock``, ``job_index``, ``fair``, ``priority``)
#: have one text.
INCLUDE = "-- @include "


#: A helper in a fragment: ``local function <name>(`` at the start of a line, through the
#: first line that is ``end`` alone (the fragments' layout; nested blocks are indented).
_HELPER = re.compile(r"^local function (\w+)\(.*?^end$\n?", re.MULTILINE | re.DOTALL)
#: A line that is only a comment (names in comments keep nothing).
_COMMENT = re.compile(r"^\s*--.*$", re.MULTILINE)


def pack_evalsha(sha: str, keys: list[str], args: list[Any]) -> bytes:
    """``EVALSHA sha len(keys) *keys *args`` in the Redis protocol, as one buffer, packed
    by hiredis (str, bytes, int or float arguments; str as UTF-8, redis-py's default
    encoding): a few µs where redis-py's own packer, which also handles memoryviews
    and splits large values, costs several times that per call. The calls sent on the
    hot paths use it: a publish, a worker's fetch and its acks."""
    try:
        return hiredis.pack_command(("EVALSHA", sha, len(keys), *keys, *args))
    except TypeError:
        bad = next(type(a).__name__ for a in args
                   if isinstance(a, bool) or not isinstance(a, str | bytes | int | float))
        raise redis.exceptions.DataError(f"celery_ext: cannot send a {bad} to Redis") from None


def used_helpers(fragment: str, script: str) -> str:
    """``fragment`` without the helpers that neither ``script`` (the rest of the script's
    text) nor a kept helper names; what is kept keeps its order, so each helper is still
    defined before the helpers that call it."""
    helpers = {m.group(1): _COMMENT.sub("", m.group(0)) for m in _HELPER.finditer(fragment)}
    rest = _HELPER.sub("", fragment)
    wanted: set[str] = set()
    todo = [_COMMENT.sub("", script), _COMMENT.sub("", rest)]
    while todo:
        text = todo.pop()
        for name, body in helpers.items():
            if name not in wanted and re.search(rf"\b{name}\b", text):
                wanted.add(name)
                todo.append(body)
    return _HELPER.sub(lambda m: m.group(0) if m.group(1) in wanted else "", fragment)


def _file(*path: str) -> str:
    return resources.files("celery_ext.store").joinpath("lua", *path).read_text("utf-8")


@cache
def source(name: str) -> str:
    """The text of ``lua/<name>.lua`` shipped with the package, its includes pasted
    (the helpers the script uses, :func:`used_helpers`)."""
    lines = _file(f"{name}.lua").splitlines(keepends=True)
    fragments = [_file("include", line[len(INCLUDE):].strip() + ".lua") for line in lines
                 if line.startswith(INCLUDE)]
    body = "".join(line for line in lines if not line.startswith(INCLUDE))
    every = "".join(fragments)
    pasted = iter([used_helpers(f, body + every.replace(f, "", 1)) for f in fragments])
    return "".join(next(pasted) if line.startswith(INCLUDE) else line for line in lines)


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
