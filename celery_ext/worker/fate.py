"""Job fate: what happens to a job that fails, expires or is started.

* :class:`JobFateRequest` is the base of the Request class ``install(app)`` sets
  (see :mod:`celery_ext.worker.request`). It runs in the worker's main process, where
  Celery acks and rejects even when the job ran in a prefork child:

  - a job that raised and will not be retried (no retries left, or an exception it
    does not retry) goes to the dead set with its name, args, kwargs, exception
    type and message, traceback, attempts, pool and node, instead of being acked
    away (during a cold shutdown, one acked late goes back to its queue instead:
    the shutdown may be why it failed); ``self.retry()`` / ``autoretry_for``
    republish into the retry set (:mod:`celery_ext.producer.scheduled`) and Celery
    acks the old message as usual;
  - a job whose ``expires`` passed before it started goes to the dead set with
    reason "expired" (Celery would only mark it revoked);
  - the ``eta`` header is ignored: a job reaches a job queue only when it is due
    (the requeuer promotes it on the Redis clock), so a worker whose clock runs
    behind must not hold it back in memory;
  - a unique job's lock is released when the job starts; a job locked until finished
    renews it then, and releases it with its move to the dead set (its ack releases it
    otherwise: :mod:`celery_ext.options.unique`);
  - a job that raised :class:`celery_ext.Throttled` goes back to the front of its job
    queue, holding its fair key (or its job queue) in all pools (``throttle.lua``). Celery
    sees a Reject with requeue: no result, no retry, nothing counted. A job acked when it
    started (``acks_late`` off) is pushed back from the message the worker has.

Retry delays (the task option ``backoff``) are :mod:`celery_ext.options.backoff`.
"""

from __future__ import annotations

import logging
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery.exceptions import Ignore, Reject, Retry, Terminated
from celery.worker import state as worker_state
from celery.worker.request import Request as CeleryRequest
from kombu.utils.json import dumps

from celery_ext.errors import Throttled
from celery_ext.options.unique import HEADER as UNIQUE_HEADER
from celery_ext.options.unique import MODE_HEADER, UNTIL_FINISHED
from celery_ext.options.unique import release as release_unique
from celery_ext.store.dead_set import MAX_TRACEBACK
from celery_ext.text import one_line

logger = logging.getLogger("celery_ext.worker.fate")

#: Exceptions after which Celery does not ack a failed job for good: retried,
#: ignored, rejected (the transport dead-letters a reject without requeue),
#: terminated, or the worker died (the pool issue's recovery counts those).
_NOT_FINAL = (Retry, Ignore, Reject, Terminated, WorkerLostError, SystemExit,
              KeyboardInterrupt, MemoryError)


def _exception_fields(exc: Any, traceback: str) -> dict[str, Any]:
    # An exception the main process cannot unpickle arrives wrapped.
    type_name = getattr(exc, "exc_cls_name", None) or type(exc).__name__
    module = getattr(exc, "exc_module", None) or type(exc).__module__
    if module and module != "builtins":
        type_name = f"{module}.{type_name}"
    message = str(exc)
    return {
        "exc_type": type_name,
        "exc_message": message[:2000],
        "error": f"{type_name}: {message[:2000]}",
        "traceback": (traceback or "")[-MAX_TRACEBACK:],
    }


class JobFateRequest(CeleryRequest):
    """Celery Request with the dead set, expiry, unique-lock and throttle handling above."""

    #: The hold (s) of a job that raised Throttled, from its failure to its reject.
    _ext_throttle: float | None = None
    acknowledged: bool

    @property
    def eta(self) -> Any:
        return None

    # -- start ----------------------------------------------------------------------------
    def on_accepted(self, pid: Any, time_accepted: Any) -> Any:
        self._ext_release_unique(renew=self._ext_until_finished())
        return super().on_accepted(pid, time_accepted)

    def _ext_until_finished(self) -> bool:
        return self._request_dict.get(MODE_HEADER) == UNTIL_FINISHED

    def _ext_release_unique(self, renew: bool = False) -> None:
        """Release this job's unique lock; with ``renew``, renew its TTL for the run."""
        digest = self._request_dict.get(UNIQUE_HEADER)
        channel: Any = getattr(self.message, "channel", None)
        if not digest or not hasattr(channel, "settings"):
            return
        renew_ms = int((getattr(self.task, "unique_ttl", None) or channel.settings.unique_ttl)
                       * 1000) if renew else 0
        try:
            with channel.conn_or_acquire() as client:
                release_unique(channel.scripts, channel.copy_of(self.message.delivery_tag),
                               str(digest), self.id, client, renew_ms=renew_ms)
        except Exception as exc:
            logger.warning("celery_ext: could not release the unique lock of %s[%s]: %s "
                           "(it expires after its TTL)", one_line(self.name),
                           one_line(self.id), exc)

    # -- failure --------------------------------------------------------------------------
    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> Any:
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if self._ext_is_final(exc):
            if worker_state.should_terminate and not self.acknowledged:
                # A cold shutdown: the failure may be the shutdown's doing, and Celery
                # would ack the job without a failure recorded. Acked late, it goes back
                # to the front of its queue and runs again (at least once); a failure of
                # its own recurs there and reaches the dead set then.
                self.reject(requeue=True)
            else:
                self._ext_dead("failed", **_exception_fields(exc, exc_info.traceback))
        elif isinstance(exc, Reject) and not exc.requeue:
            # The transport would dead-letter the reject too, without the why.
            self._ext_dead("rejected", **_exception_fields(exc, exc_info.traceback))
        elif isinstance(exc, Throttled):
            # Celery rejects it with requeue next (self.reject): hold there.
            self._ext_throttle = exc.seconds
        try:
            return super().on_failure(exc_info, send_failed_event=send_failed_event,
                                      return_ok=return_ok)
        finally:
            self._ext_throttle = None

    # -- throttled ------------------------------------------------------------------------
    def reject(self, requeue: bool = False) -> None:
        seconds = self._ext_throttle
        if requeue and seconds is not None and self._ext_throttled(seconds):
            return
        super().reject(requeue=requeue)

    def _ext_throttled(self, seconds: float) -> bool:
        """Put this job back at the front of its queue, holding its fair key or queue
        ``seconds`` (``Channel.throttle_job``). False: not done (not our transport, or
        Redis failed), and Celery's reject with requeue applies (no hold)."""
        message = self.message
        throttle = getattr(getattr(message, "channel", None), "throttle_job", None)
        if throttle is None:
            return False
        job = b""
        if message.acknowledged:  # acks_late off: it left the in-flight record at start
            queue = (message.delivery_info or {}).get("routing_key") or self.name
            raw = message.serializable()
            # Its properties last, as the producer wrote them: the scripts read the fair
            # key, the delivery tag and the task id from the payload's last bytes.
            raw["properties"] = raw.pop("properties")
            job = f"{queue}\n{dumps(raw)}".encode()
        try:
            held = throttle(message.delivery_tag, seconds, job)
        except Exception as exc:
            logger.error("celery_ext: could not throttle %s[%s]: %s", one_line(self.name),
                         one_line(self.id), exc)
            return False
        self.acknowledged = True
        if held is None:  # (its pool was declared dead meanwhile: the reaper has it)
            return True
        self.send_event("task-rejected", requeue=True)
        logger.info("celery_ext: job %s[%s] throttled: back at the front of its queue, its %s "
                    "held for %g s", one_line(self.name), one_line(self.id),
                    "fair key" if held == "key" else "job queue", seconds)
        return True

    def _ext_is_final(self, exc: Any) -> bool:
        """Will Celery drop this failed job for good (ack, or reject without requeue)?
        Also during a cold shutdown, where Celery acks a failed job and stores nothing."""
        if isinstance(exc, _NOT_FINAL):
            return False
        task = self.task
        if task.acks_late and isinstance(exc, TimeLimitExceeded):
            return bool(getattr(task, "acks_on_timeout", True))  # else requeued
        return True

    # -- expiry ---------------------------------------------------------------------------
    def _announce_revoked(self, reason: Any, terminated: Any, signum: Any,
                          expired: Any) -> Any:
        if expired and not self.acknowledged:
            expires = self.expires
            self._ext_dead("expired", error=f"expired at {expires.isoformat()}"
                           if expires is not None else "expired")
            if not self._ext_until_finished():  # (else released with the dead move)
                self._ext_release_unique()
        return super()._announce_revoked(reason, terminated, signum, expired)

    # -- dead set -------------------------------------------------------------------------
    def _ext_dead(self, reason: str, error: str = "", **fields: Any) -> bool:
        """Record this job in the dead set (moving it out of the in-flight record)."""
        message = self.message
        channel = getattr(message, "channel", None)
        dead_letter = getattr(channel, "_dead_letter", None)
        if dead_letter is None:
            return False  # not the celery_ext transport
        fallback = ""
        if message.acknowledged:  # acks_late off: it left the in-flight record at start
            try:
                queue = (message.delivery_info or {}).get("routing_key") or self.name
                fallback = f"{queue}\n{dumps(message.serializable())}"
            except Exception:
                logger.debug("celery_ext: cannot serialize %s[%s] for the dead set",
                             one_line(self.name), one_line(self.id), exc_info=True)
        try:
            moved = bool(dead_letter(
                message.delivery_tag, reason, error, fallback=fallback,
                name=self.name, task_id=self.id, args=self.args, kwargs=self.kwargs,
                attempts=int(self._request_dict.get("retries") or 0) + 1,
                hostname=self.hostname, **fields,
                **({"unique_digest": str(self._request_dict.get(UNIQUE_HEADER))}
                   if self._ext_until_finished() else {})))
        except Exception as exc:
            logger.error("celery_ext: could not move %s[%s] to the dead set: %s",
                         one_line(self.name), one_line(self.id), exc)
            return False
        if moved:
            logger.warning("celery_ext: job %s[%s] moved to the dead set (%s: %s)",
                           one_line(self.name), one_line(self.id), reason, one_line(error))
        return moved
