"""Stop requests: the running jobs a person asked to stop, read by their checkins.

    {ns}:stop_requests   zset   job id -> Redis ms after which the request lapses

A person asks through the client (``Client.request_stop``); the job's next checkin
(``checkin.lua``) answers "stop" while its entry has not lapsed, and the end of the job
in its pool (``busy.lua``, "end" or "lost") removes the entry.

The set stays bounded, whoever asks and however often: a request is taken only for a job
in flight now (the job index finds it in flight, :func:`~.job_index.lookup`, or a
busy-worker record or a checkin record names it), and every entry lapses
``stop_request_ttl`` seconds after it was asked, so an entry whose end nobody reports (a
pool killed outright, a job that ended as it was asked) does not outlive that. Each
request drops the lapsed entries: the set holds at most the jobs asked within the last
``stop_request_ttl``, each of which was in flight when asked.
"""

from __future__ import annotations

import json
from typing import Any

from kombu.utils.encoding import bytes_to_str

from celery_ext.config import Settings
from celery_ext.store.clock import now_ms
from celery_ext.store.job_index import lookup
from celery_ext.store.keys import Keys


def requested(deadline: Any, now: int) -> bool:
    """Whether a stop request read as ``ZSCORE`` (None: none) holds at Redis ``now`` ms."""
    return deadline is not None and float(deadline) > now


def _busy_job_id(raw: bytes | str) -> str | None:
    """The job id of a busy-worker record ``"<started ms>\\n<job json>"``, or None."""
    try:
        record = json.loads(bytes_to_str(raw).split("\n", 1)[1])
    except (ValueError, IndexError):
        return None
    job_id = record.get("job_id") if isinstance(record, dict) else None
    return job_id if isinstance(job_id, str) else None


def in_flight(client: Any, keys: Keys, job_id: str) -> bool:
    """Whether ``job_id`` is in flight now: by the job index (reserved or running in
    a pool), else by a checkin record or a busy-worker record of a registered pool
    (the only trace of a job when the index is off)."""
    entry = lookup(client, keys, job_id)
    if entry is not None and entry["state"] == "inflight":
        return True
    home = keys.home
    pool_ids = [bytes_to_str(p) for p in client.zrange(home.pools, 0, -1)]
    with client.pipeline(transaction=False) as pipe:
        pipe.hexists(home.checkins, job_id)
        for pool_id in pool_ids:
            pipe.hvals(home.busy(pool_id))
        checked_in, *busy = pipe.execute()
    return bool(checked_in) or any(_busy_job_id(raw) == job_id
                                   for records in busy for raw in records)


def request_stop(client: Any, settings: Settings, job_id: str) -> bool:
    """Ask the job ``job_id`` to stop at its next checkin; False (and nothing written)
    when it is not in flight. The lapsed requests are dropped in the same MULTI."""
    keys = Keys.for_settings(settings)  # the home copy, where the requests live
    if not in_flight(client, keys, job_id):
        return False
    now = now_ms(client)
    with client.pipeline(transaction=True) as pipe:
        pipe.zremrangebyscore(keys.stop_requests, "-inf", now)
        pipe.zadd(keys.stop_requests, {job_id: now + int(settings.stop_request_ttl * 1000)})
        pipe.execute()
    return True
