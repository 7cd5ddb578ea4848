"""The job index: where a job is now, by its Celery task id, in one read.

The scripts that move a job (enqueue, enqueue_unique, periodic_run, schedule, promote,
fetch, ack, requeue, recover, dead, dead_retry, forget) write the job's entry in the
same script as the move (``store/lua/include/job_index.lua``), so the entry cannot disagree with
where the job is. One hash field per job::

    {ns}:jobs        task id -> "<state>\\n<ms>\\n<queue>\\n<ref>\\n<detail>"
    {ns}:jobs_done   task id -> ms after which its finished entry is trimmed

========== ====================== =========================
state      ref                    detail
========== ====================== =========================
queued     priority level         (empty)
inflight   delivery tag           pool id
scheduled  job id in the set      due time (ms)
retry      job id in the set      due time (ms)
dead       dead job id            reason
done       delivery tag           pool id (of the last run)
========== ====================== =========================

``ms`` is the Redis time of the move. Bounds: a live entry is replaced as the job moves
and removed when the job is deleted (forget, dead-set trim); a ``done`` entry is kept
``job_index_ttl`` seconds: each finish trims up to 20 expired ones, and every worker
pool's reaper trims up to :data:`TRIM_STEP` per copy at each of its ticks
(:func:`trim_finished`), so entries expire also when nothing runs after them, and the
index holds the live jobs plus the jobs finished within the TTL (and what the trims
have not reached yet). A move of one copy of a job never
overwrites the entry of another copy with the same task id: Celery schedules a retry
under the task id before the failed run is acked, so that ack leaves the entry saying
``retry``.

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
from celery_ext.store.copies import copies, per_copy, run_scripts
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
    if len(parts) != 5 or parts[0] not in STATES or not parts[1].isdigit():
        return None
    return IndexEntry(state=parts[0], at=int(parts[1]) / 1000, queue=parts[2],
                      ref=parts[3], detail=parts[4])


def lookup(client: Any, keys: Keys, task_id: str) -> IndexEntry | None:
    """Where the job ``task_id`` is now, by the index (one HGET). On a cluster the
    entry is in its job queue's copy: every copy is asked, in one pipeline."""
    if not keys.cluster:
        return parse(client.hget(keys.job_index, task_id))
    for (raw,) in per_copy(client, copies(client, keys),
                           lambda pipe, copy: pipe.hget(copy.job_index, task_id)):
        if raw is not None:
            return parse(raw)
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
