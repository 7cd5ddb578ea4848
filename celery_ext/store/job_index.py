"""The job index: where a job is now, by its Celery task id, in one read.

The scripts that move a job (enqueue, enqueue_unique, periodic_run, schedule, promote,
ack, requeue, recover, dead, dead_retry, forget) write the job's entry in the
same script as the move (``store/lua/include/job_index.lua``), so the entry cannot disagree with
where the job is. One hash field per job::

    {ns}:jobs        task id -> "<state>\\n<ms>\\n<queue>\\n<ref>\\n<detail>"
                     (a done entry adds "\\n<queued ms>", below)
    {ns}:jobs_done   task id -> ms after which its finished entry is trimmed

========== ====================== =========================
state      ref                    detail
========== ====================== =========================
queued     priority level         delivery tag
scheduled  job id in the set      due time (ms)
retry      job id in the set      due time (ms)
dead       dead job id            reason
done       delivery tag           pool id (of the last run)
inflight   delivery tag           pool id (written by workers of earlier versions only)
========== ====================== =========================

The fetch does not write the index: a job in flight keeps its ``queued`` entry, whose
delivery tag is the field of its record in the pool's in-flight hash (a random field of
a hash of every queued job is out of the CPU's caches, and writing it was the whole of
the fetch's growth with a backlog: bench/README.md). :func:`lookup` resolves it in one
script (``job_where.lua``) and returns such an entry as ``inflight`` in that pool, the
form every reader takes; the scripts that move an in-flight job accept either form.

``ms`` is the Redis time of the move (for a job in flight: of the move that queued it).
A done entry also keeps the ms of the entry it replaced, the move that queued the run it
ended: the ack that writes it may come long after the run stored its outcome (acks
batched, a warm stop, a Redis outage), so the outcome's time is checked against when the
run was queued, not against the ack (``admin/job_status.py``). An entry written by an
earlier version has no such field: its ``queued_at`` is None.
Bounds: a live entry is replaced as the job moves and removed when the job is deleted
(forget, dead-set trim); a ``done`` entry is kept ``job_index_ttl`` seconds: each finish
trims up to 20 expired ones, and every worker pool's reaper trims up to
:data:`TRIM_STEP` per copy at each of its ticks (:func:`trim_finished`), so entries
expire also when nothing runs after them, and the index holds the live jobs plus the
jobs finished within the TTL (and what the trims have not reached yet). A move of one
copy of a job never overwrites the entry of another copy with the same task id: Celery
schedules a retry under the task id before the failed run is acked, so that ack leaves
the entry saying ``retry``.

The task id comes from the payload (Celery's ``correlation_id``, in the last bytes of
Kombu's JSON, so reading it costs the same whatever the body's size) in the worker
scripts, and from the producer, which has it, in the enqueue scripts. A job enqueued
before the index existed, or with ``job_index=False``, has no entry: ``status.py`` then
searches the sets as it did before.
"""

from __future__ import annotations

from typing import Any, TypedDict

from kombu.utils.encoding import bytes_to_str

from celery_ext.config import Settings
from celery_ext.store.copies import copies, run_scripts
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts

#: The states an entry can say.
STATES = ("queued", "inflight", "scheduled", "retry", "dead", "done")
#: Most finished entries one periodic trim call handles in one copy: bounds the time
#: Redis spends in it at each reaper tick (about 1 ms per 1,000).
TRIM_STEP = 1000


class IndexEntry(TypedDict):
    state: str
    at: float  # Redis-clock seconds of the move that wrote the entry
    queue: str
    ref: str
    detail: str
    queued_at: float | None  # a done entry's: seconds of the move that queued its run


def index_keys(keys: Keys) -> list[str]:
    """The two KEYS every job-moving script takes for the index."""
    return [keys.job_index, keys.job_index_done]


def index_ttl_ms(settings: Settings) -> int:
    """The ARGV the scripts take: finished entries' TTL in ms, 0 = index off."""
    return max(1, int(settings.job_index_ttl * 1000)) if settings.job_index else 0


def parse(raw: bytes | str | None) -> IndexEntry | None:
    """An entry of ``{ns}:jobs``, or None for a missing or unreadable one."""
    if raw is None:
        return None
    parts = bytes_to_str(raw).split("\n")
    if len(parts) not in (5, 6) or parts[0] not in STATES or not parts[1].isdigit():
        return None
    queued = parts[5] if len(parts) == 6 else ""
    return IndexEntry(state=parts[0], at=int(parts[1]) / 1000, queue=parts[2],
                      ref=parts[3], detail=parts[4],
                      queued_at=int(queued) / 1000 if queued.isdigit() else None)


def where_call(keys: Keys, task_id: str) -> tuple[str, list[str], list[Any]]:
    """Name, KEYS and ARGV of the ``job_where`` call reading ``task_id`` in the copy
    ``keys``."""
    return ("job_where", [keys.job_index, keys.inflight_pools], [task_id, keys.inflight("")])


def resolve(reply: Any) -> IndexEntry | None:
    """The entry of a ``job_where`` reply; a queued entry whose tag a pool holds in
    flight is returned as that job ``inflight`` in that pool (ref: the tag, detail: the
    pool id), as an entry of the earlier format says it."""
    if not reply:
        return None
    raw, pool = reply
    entry = parse(raw)
    pool = bytes_to_str(pool)
    if entry is not None and entry["state"] == "queued" and pool:
        return IndexEntry(state="inflight", at=entry["at"], queue=entry["queue"],
                          ref=entry["detail"], detail=pool, queued_at=None)
    return entry


def lookup(client: Any, keys: Keys, task_id: str,
           scripts: Scripts | None = None) -> IndexEntry | None:
    """Where the job ``task_id`` is now, by the index: one ``job_where`` call, which
    reads the entry and, for a queued one, whether a pool holds it in flight, at once
    (:func:`resolve`). On a cluster the entry is in its job queue's copy: every copy is
    asked, in one pipeline per master."""
    scripts = scripts or Scripts(client)
    calls = [where_call(copy, task_id) for copy in copies(client, keys)]
    for reply in run_scripts(client, scripts, calls):
        if reply:
            return resolve(reply)
    return None


def trim_finished(client: Any, scripts: Scripts, keys: Keys, settings: Settings) -> int:
    """Delete the finished entries whose ``job_index_ttl`` has passed, at most
    :data:`TRIM_STEP` in each copy (one script call per copy; on a cluster one pipeline
    per master), and return how many were handled. Finishes trim only the entries of
    their own copy, and only while jobs finish; the reaper runs this at every tick, so
    the entries of a queue that stopped running jobs expire too. Nothing with the
    index off."""
    ttl = index_ttl_ms(settings)
    if not ttl:
        return 0
    calls = [("job_index_trim", index_keys(copy), [ttl, TRIM_STEP])
             for copy in copies(client, keys)]
    return sum(int(n) for n in run_scripts(client, scripts, calls))
