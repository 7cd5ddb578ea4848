"""The Celery Request class ``install(app)`` sets: counts lost workers per job.

When a prefork child dies mid-job, Celery (with ``task_reject_on_worker_lost``)
rejects the message with requeue. This class routes that one case through the
``recover`` script instead: the job goes back to the front of its queue at once
with its recovery count incremented, or, past ``max_recoveries``, into the dead
set as a poison pill, so one job that kills its worker cannot take the fleet down.
The dead process's busy record and checkin are dropped first (they would otherwise
stay for the pool's lifetime).
Its base, :class:`celery_ext.worker.fate.JobFateRequest`, sends failed and expired jobs to
the dead set, ignores the ``eta`` of promoted jobs and releases unique-job locks.
"""

from __future__ import annotations

from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import WorkerLostError

from celery_ext.worker.fate import JobFateRequest
from celery_ext.worker.observer import job_lost


class Request(JobFateRequest):
    _ext_worker_lost = False
    acknowledged: bool

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> Any:
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        self._ext_worker_lost = isinstance(exc, WorkerLostError | SystemExit)
        if self._ext_worker_lost:
            # Before the job is requeued: its rerun writes records of the same job id.
            job_lost(self.task.app, self.id)
        try:
            return super().on_failure(exc_info, send_failed_event=send_failed_event,
                                      return_ok=return_ok)
        finally:
            self._ext_worker_lost = False

    def reject(self, requeue: bool = False) -> None:
        if requeue and self._ext_worker_lost and not self.acknowledged:
            recover = getattr(self.message.channel, "recover_lost", None)
            if recover is not None:
                outcome = recover(self.message.delivery_tag)
                self.acknowledged = True
                if outcome == "dead":
                    self.task.backend.mark_as_failure(
                        self.id, WorkerLostError("worker lost too many times: dead set"),
                        request=self._context, store_result=self.store_errors)
                    self.send_event("task-failed", exception="WorkerLostError (dead set)")
                else:
                    self.send_event("task-rejected", requeue=True)
                return
        super().reject(requeue=requeue)
