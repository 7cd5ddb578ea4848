"""A job that ends in the dead set without Celery seeing it end fails its result and its
chord with the reason, instead of leaving them pending forever.

Celery reports a job that raised, expired or names an unknown task (the backend stores
its failure, its chord counts it). A poison pill (its worker died under it too often), an
undecodable, invalid or rejected message goes to the dead set where Celery never sees it:
its ``get()`` would wait forever and its chord would hang. The dead set calls
:class:`DeadJobResults` (registered with ``store/dead_set.on_dead`` when the backend is
made in a process) for each job it takes in; it stores a ``DeadJob`` failure with the
reason under the job's id and, for a chord's header job, counts it, so the chord fails
through its error callbacks once its header is complete. The chord's body comes from the
message, or from the chord's record (``apply_chord`` keeps it there) when the message
cannot be decoded. Counting by task id makes a job reported twice count once.
"""

from __future__ import annotations

import base64
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from celery.app.task import Context
from celery.utils.log import get_logger
from kombu.serialization import loads

from celery_ext.errors import DeadJob

logger = get_logger(__name__)

#: Reasons of the dead set that Celery already reports to the result backend.
CELERY_REPORTS = frozenset({"failed", "unknown_task", "expired"})


@dataclass(frozen=True)
class DeadJobResults:
    """The dead-set listener of one app (equal for the same app: registered once)."""

    app: Any

    def __call__(self, envelope: dict[str, Any], meta: dict[str, Any]) -> None:
        reason = str(meta.get("reason") or "dead")
        if reason in CELERY_REPORTS:
            return
        found = envelope.get("headers")
        headers: dict[str, Any] = found if isinstance(found, dict) else {}
        task_id = headers.get("id") or meta.get("task_id")
        if not isinstance(task_id, str) or not task_id:
            return
        embed = _embed(envelope)
        backend = self.app.backend
        group = headers.get("group")
        chord = embed.get("chord")
        if group and not chord and hasattr(backend, "chord_body"):
            chord = backend.chord_body(group)
        request = Context(
            id=task_id, task=headers.get("task"), group=group,
            group_index=headers.get("group_index"), chord=chord,
            errbacks=embed.get("errbacks"), chain=embed.get("chain"),
            root_id=headers.get("root_id"), parent_id=headers.get("parent_id"))
        error = str(meta.get("error") or "")
        exc = DeadJob(f"{reason}: {error}" if error else reason)
        logger.warning("celery_ext: job %s went to the dead set (%s); its result fails",
                       task_id, reason)
        # Tried once: this runs in the reaper's thread or the fetch's, which a result
        # backend that is away must not hold up (the failure is logged by the dead set).
        single_try = getattr(backend, "single_try", None)
        with single_try() if single_try is not None else nullcontext():
            backend.mark_as_failure(task_id, exc, request=request)


def _embed(envelope: dict[str, Any]) -> dict[str, Any]:
    """The callbacks, errbacks, chain and chord of a task message (protocol 2), or {}
    when its body cannot be read (that is often why the job is dead)."""
    props = envelope.get("properties") or {}
    body = envelope.get("body")
    if not isinstance(body, str) or not isinstance(props, dict):
        return {}
    try:
        raw = base64.b64decode(body) if props.get("body_encoding") == "base64" else body
        decoded = loads(raw, envelope.get("content-type") or "application/json",
                        envelope.get("content-encoding") or "utf-8",
                        accept={"application/json"})
        embed = decoded[2]
    except Exception:  # an undecodable job: the chord's record has the body
        return {}
    return embed if isinstance(embed, dict) else {}
