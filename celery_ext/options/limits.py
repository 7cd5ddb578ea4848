"""Per-job concurrency limits (task option ``max_concurrency=N``).

The fetch script skips a job queue whose in-flight count (``{ns}:running``, all
pools) has reached its limit in ``{ns}:limits``. In-flight means fetched and not
finished, so the limit needs ``acks_late`` (``install(app)``'s default): a job
acked when it starts no longer counts while it runs. A dead pool's share is
released by the reaper when it requeues the pool's jobs, so the count never drifts.

Worker pools write the limits of the job queues they consume from their task
options when they start; the most recently started pool wins. A queue whose tasks
declare no limit has its limit removed, so the code stays the source of truth
(``Client.set_max_concurrency`` changes it until the next pool starts).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kombu.utils.encoding import bytes_to_str

from celery_ext.store.copies import per_copy
from celery_ext.store.keys import Keys


def job_limits(app: Any, option: str = "max_concurrency") -> dict[str, int]:
    """Job queue -> max_concurrency (or another whole-number task ``option``, e.g.
    ``fair_max_concurrency``) for every registered task that declares one (tasks
    sharing a queue: the smallest limit)."""
    app.finalize(auto=True)
    limits: dict[str, int] = {}
    for name, task in sorted(app.tasks.items()):
        limit = getattr(task, option, None)
        if limit is None:
            continue
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"celery_ext: task {name!r} has {option}={limit!r}; "
                             "it must be a whole number >= 1 (or None for no limit)")
        queue = getattr(task, "queue", None) or name
        limits[queue] = min(limit, limits.get(queue, limit))
    return limits


def write_limits(client: Any, keys: Keys, limits: Mapping[str, int],
                 consumed: Iterable[str], hash_name: str = "limits",
                 reset_name: str | None = None, suffix: str = "") -> list[str]:
    """Set the limits of the consumed queues (removing undeclared ones) and wake
    pools that may have been waiting on a queue whose limit changed. ``hash_name``:
    the Keys attribute of another hash of limits than ``limits`` (``rate_limits``);
    ``reset_name``: of a hash whose field of each changed queue is deleted with it (a
    rate limit's state); ``suffix``: after the queue name in its field (``"\n"``: the
    per-key limit of a fair queue). Each queue's limit is written in its own copy (on
    a cluster, ``Keys.of``: fetch reads it there).

    Only the changes are written and published (one read first): a pool consuming
    1,000 job queues would otherwise send 2,000 commands at every start and wake
    every idle pool 1,000 times. Returns the queues whose limit changed."""
    consumed = set(consumed) | set(limits)
    if not consumed:
        return []
    groups = keys.groups(sorted(consumed))
    parts = list(groups)
    current: dict[str, str] = {}
    for copy, (found,) in zip(parts, per_copy(
            client, parts, lambda p, c: p.hgetall(getattr(c, hash_name))), strict=True):
        fields = {queue + suffix: queue for queue in groups[copy]}
        current.update((fields[bytes_to_str(k)], bytes_to_str(v)) for k, v in found.items()
                       if bytes_to_str(k) in fields)
    changed = [queue for queue in sorted(consumed)
               if current.get(queue) != (str(limits[queue]) if queue in limits else None)]
    if not changed:
        return []
    with client.pipeline() as pipe:
        for queue in changed:
            copy = keys.of(queue)
            if queue in limits:
                pipe.hset(getattr(copy, hash_name), queue + suffix, limits[queue])
            else:
                pipe.hdel(getattr(copy, hash_name), queue + suffix)
            if reset_name:
                pipe.hdel(getattr(copy, reset_name), queue)
            if not keys.cluster:
                pipe.publish(keys.wake_channel, queue)
        pipe.execute()
    if keys.cluster:  # a cluster's pipeline cannot carry a PUBLISH
        for queue in changed:
            client.publish(keys.wake_channel, queue)
    return changed
