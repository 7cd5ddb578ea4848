"""Celery's remote-control commands that answer from Redis instead of a worker's memory.

Registered by the worker parts (``bootsteps.add_worker_parts``, both modes) in Celery's
``Panel``, in place of Celery's own commands of the same name; a worker whose broker is
not ours answers as Celery does.

* ``inspect revoked``: the revokes that hold in Redis (``store/revoked.py``), so a worker
  started after a revoke lists it, without mingle; and the ids this worker was told.
* ``hello`` (mingle, at a worker's start): Celery's reply carries every revoked id the
  worker holds (up to 50,000, about 40 bytes each: 2.0 MB of JSON, 2.7 MB in its reply
  key once Kombu base64-encodes it, per worker that replies). Every fetch
  checks the revokes in Redis, so a starting worker needs none of them: the reply carries
  the clock only, and the ids a peer sends are still merged as Celery does.

And what Celery does for a revoked job it receives, for the jobs the fetch drops as
revoked (:func:`mark_revoked`): their results say ``REVOKED``, so a caller waiting on one
is answered (a revoke sent while no worker was up has no worker to do it otherwise), and a
worker that sends events (``-E``) announces each with ``task-revoked`` (Flower).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from celery import states

from celery_ext.store.keys import Keys
from celery_ext.store.revoked import revoked_ids
from celery_ext.text import one_line

logger = logging.getLogger("celery_ext.worker.control")


def _our_channel(state: Any) -> Any:
    """The consumer's channel when the broker is ours, else None."""
    connection = getattr(getattr(state, "consumer", None), "connection", None)
    channel = getattr(connection, "default_channel", None) if connection else None
    return channel if hasattr(type(channel), "worker_pool") else None


def revoked(state: Any, **kwargs: Any) -> list[str]:
    """List of revoked task-ids (from Redis, with the ones this worker was told)."""
    from celery.worker import state as worker_state

    channel = _our_channel(state)
    mine = list(worker_state.revoked)
    if channel is None:
        return mine
    with channel.conn_or_acquire() as client:
        held = revoked_ids(client, Keys.for_settings(channel.settings))
    return held + sorted(set(mine) - set(held))


def hello(state: Any, from_node: str, revoked: Any = None, **kwargs: Any) -> Any:
    """Request mingle sync-data."""
    from celery.worker import state as worker_state

    if from_node == state.hostname:
        return None
    logger.info("sync with %s", from_node)
    if revoked:
        worker_state.merge_revoked(revoked)
    if _our_channel(state) is None:
        worker_state.revoked.purge()
        return {"revoked": list(worker_state.revoked), "clock": state.app.clock.forward()}
    return {"revoked": [], "clock": state.app.clock.forward()}


def register() -> None:
    """Put the commands above in Celery's registry (idempotent)."""
    from celery.worker.control import Panel, inspect_command

    if Panel.data.get("revoked") is not revoked:
        inspect_command(alias="dump_revoked")(revoked)
    if Panel.data.get("hello") is not hello:
        inspect_command(visible=False)(hello)


#: The result states a revoke overwrites (Celery's ``_revoke`` leaves the others alone:
#: a result there already, or a job another worker started).
REVOCABLE = (states.PENDING, states.RECEIVED, states.RETRY, states.REJECTED)


#: The worker's consumer (``bootsteps.RevokedEvents``): its event dispatcher announces the
#: jobs the fetch drops as revoked.
_consumer: weakref.ReferenceType[Any] | None = None


def watch(consumer: Any) -> None:
    """Announce dropped revoked jobs through ``consumer``'s events (when it sends any)."""
    global _consumer
    _consumer = weakref.ref(consumer)


def mark_revoked(task_ids: list[str], backend: Any = None) -> None:
    """Mark the results of revoked jobs as revoked in ``backend`` (default the worker's
    app's, for the jobs its fetch dropped: those are also announced with a ``task-revoked``
    event when the worker sends events; no backend configured: no result). A backend or
    an event that fails is logged on one line."""
    from celery import current_app
    from celery.backends.base import DisabledBackend

    if backend is None:
        backend = current_app.backend
        consumer = _consumer() if _consumer is not None else None
        dispatcher = getattr(consumer, "event_dispatcher", None)
        if dispatcher is not None and dispatcher.enabled:
            for task_id in task_ids:
                try:
                    dispatcher.send("task-revoked", uuid=task_id, terminated=False,
                                    signum=None, expired=False)
                except Exception as exc:
                    logger.warning("celery_ext: could not announce revoked job %s: %s",
                                   one_line(task_id), one_line(f"{exc}"))
    if isinstance(backend, DisabledBackend):
        return
    for task_id in task_ids:
        try:
            if backend.get_state(task_id) in REVOCABLE:
                backend.mark_as_revoked(task_id, reason="revoked", store_result=True)
        except Exception as exc:
            logger.warning("celery_ext: could not mark the result of revoked job %s: %s",
                           one_line(task_id), one_line(f"{exc}"))
