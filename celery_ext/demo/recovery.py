"""The demo's kill and recovery: the jobs a SIGKILLed worker pool owned, followed in
Redis and the result backend until they ran again on the surviving pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kombu.utils.encoding import bytes_to_str

from celery_ext.client import Client
from celery_ext.demo.show import Out, job_label
from celery_ext.store.clock import now_ms
from celery_ext.store.compact import headers_of
from celery_ext.store.job_index import lookup


@dataclass
class Recovery:
    """Follows the jobs a killed pool owned, as Redis and the result backend record
    them: requeued by the reaper (the pool leaves ``{ns}:pools``, its in-flight record
    empties, each job gets a recovery count in ``{ns}:redelivery``), then run by the
    surviving pool (the result's ``worker``, stored with ``result_extended``)."""

    admin: Client
    pool_id: str
    node: str
    killed_at_ms: int
    #: delivery tag -> (job id, job name), from the killed pool's in-flight record.
    jobs: dict[str, tuple[str, str]]
    reaped_after: float | None = None
    recoveries: dict[str, int] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)
    #: job id -> when its result was stored before the kill (a finished run that was
    #: not yet acked, or an earlier attempt of a retried job): not this recovery's run.
    before: dict[str, Any] = field(default_factory=dict)
    done: bool = False

    @classmethod
    def snapshot(cls, admin: Client, pool_id: str, node: str) -> Recovery:
        """Read the killed pool's in-flight record (it stays in Redis until reaped)."""
        jobs: dict[str, tuple[str, str]] = {}
        for tag, record in admin.client.hgetall(admin.keys.inflight(pool_id)).items():
            _queue, payload = bytes_to_str(record).split("\n", 1)
            headers = headers_of(payload)
            jobs[bytes_to_str(tag)] = (str(headers.get("id")), str(headers.get("task")))
        return cls(admin, pool_id, node, now_ms(admin.client), jobs)

    def note_results(self, app: Any) -> None:
        self.before = {job_id: app.AsyncResult(job_id).date_done
                       for job_id, _name in self.jobs.values()}

    def poll(self, app: Any, out: Out) -> None:
        client, k = self.admin.client, self.admin.keys
        tags = list(self.jobs)
        if self.reaped_after is None:
            with client.pipeline(transaction=False) as pipe:
                pipe.zscore(k.pools, self.pool_id)
                pipe.exists(k.inflight(self.pool_id))
                pipe.hmget(k.redelivery, tags or ["-"])
                beat, owns, counts = pipe.execute()
            if beat is not None or owns:
                return
            self.reaped_after = (now_ms(client) - self.killed_at_ms) / 1000
            self.recoveries = {t: int(c) for t, c in zip(tags, counts, strict=False) if c}
            out.event(
                f"reaper: pool {self.node} declared dead "
                f"{self.reaped_after:.1f}s after the kill; its in-flight record is empty and "
                f"its {len(self.jobs)} job(s) are back at the front of their queues "
                f"({len(self.recoveries)} with recovery count 1 in Redis now, the others "
                f"already fetched and finished again)")
        for tag, (job_id, name) in self.jobs.items():
            if tag in self.finished:
                continue
            result = app.AsyncResult(job_id)
            if result.state in ("SUCCESS", "FAILURE", "RETRY", "REVOKED") \
                    and result.date_done != self.before.get(job_id):
                worker = str(result.worker or "?").split("@")[0]
                self.finished[tag] = worker
                resumed = result.result.get("resumed_from") \
                    if isinstance(result.result, dict) else None
                out.event(f"recovered job {job_label(name, job_id)} ran on {worker}: "
                          f"{result.state}" + (f", resumed after step {resumed} (its cursor)"
                                               if resumed else ""))
            elif self.before.get(job_id) is not None:
                self._rerun_after_its_result(job_id, name, tag, out)
        if len(self.finished) == len(self.jobs) and self.reaped_after is not None:
            self.done = True
            by = sorted(set(self.finished.values()))
            out.event(f"recovery complete: all {len(self.jobs)} job(s) pool "
                      f"{self.node} owned when it was killed "
                      f"ran again on {', '.join(by) or '-'}; none lost")

    def _rerun_after_its_result(self, job_id: str, name: str, tag: str, out: Out) -> None:
        """A job whose run finished just before the kill, its ack not yet written: it runs
        again (at least once), but Celery's backend keeps the first SUCCESS rather than
        overwrite it, so the job index tells of the rerun: its entry says done, by another
        pool, at a move after the kill."""
        entry = lookup(self.admin.client, self.admin.keys, job_id)
        if entry is None or entry["state"] != "done" or entry["detail"] in ("", self.pool_id) \
                or entry["at"] * 1000 <= self.killed_at_ms:
            return
        node = self.admin.client.hget(self.admin.keys.pool(entry["detail"]), "node")
        worker = bytes_to_str(node).split("@")[0] if node else entry["detail"]
        self.finished[tag] = worker
        out.event(f"recovered job {job_label(name, job_id)} ran on {worker} (its first run "
                  "had finished before the kill, its ack had not; Celery keeps the first "
                  "result)")
