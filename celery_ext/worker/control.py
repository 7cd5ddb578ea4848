"""Celery's remote-control commands that answer from Redis instead of a worker's memory.

Registered by the worker parts (``bootsteps.add_worker_parts``, both modes) in Celery's
``Panel``, in place of Celery's own commands of the same name; a worker whose broker is
not ours answers as Celery does.

* ``inspect revoked``: the revokes that hold in Redis (``store/revoked.py``), so a worker
  started after a revoke lists it, without mingle; and the ids this worker was told.
* ``hello`` (mingle, at a worker's start): Celery's reply carries every revoked id the
  worker holds (up to 50,000, about 40 bytes each: 2 MB in one reply key). Every fetch
  checks the revokes in Redis, so a starting worker needs none of them: the reply carries
  the clock only, and the ids a peer sends are still merged as Celery does.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker import state as worker_state
from celery.worker.control import Panel, inspect_command

from celery_ext.store.keys import Keys
from celery_ext.store.revoked import revoked_ids

logger = logging.getLogger("celery_ext.worker.control")


def _our_channel(state: Any) -> Any:
    """The consumer's channel when the broker is ours, else None."""
    connection = getattr(getattr(state, "consumer", None), "connection", None)
    channel = getattr(connection, "default_channel", None) if connection else None
    return channel if hasattr(type(channel), "worker_pool") else None


def revoked(state: Any, **kwargs: Any) -> list[str]:
    """List of revoked task-ids (from Redis, with the ones this worker was told)."""
    channel = _our_channel(state)
    mine = list(worker_state.revoked)
    if channel is None:
        return mine
    with channel.conn_or_acquire() as client:
        held = revoked_ids(client, Keys.for_settings(channel.settings))
    return held + sorted(set(mine) - set(held))


def hello(state: Any, from_node: str, revoked: Any = None, **kwargs: Any) -> Any:
    """Request mingle sync-data."""
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
    if Panel.data.get("revoked") is not revoked:
        inspect_command(alias="dump_revoked")(revoked)
    if Panel.data.get("hello") is not hello:
        inspect_command(visible=False)(hello)
