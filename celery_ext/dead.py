"""The dead set: jobs that will not run again unless a person says so, with why.

Written by the worker side (undecodable or rejected messages, poison pills,
exhausted retries); read and steered through ``celery_ext.client``.
"""

from __future__ import annotations

import json
from typing import Any

from .config import Settings
from .keys import Keys
from .scripts import Scripts


def dead_letter(client: Any, settings: Settings, pool_id: str, tag: str, *,
                reason: str, error: str = "", **meta: Any) -> bool:
    """Move one in-flight job of ``pool_id`` to the dead set atomically.

    Returns False when the job was no longer in flight (already moved elsewhere).
    """
    keys = Keys(settings.namespace)
    record = json.dumps({"reason": reason, "error": error, "pool": pool_id, **meta},
                        default=repr, separators=(",", ":"))
    moved = Scripts(client)(
        "dead",
        [keys.inflight(pool_id), keys.dead, keys.dead_jobs, keys.redelivery, keys.running],
        [tag, record, settings.dead_max_size, int(settings.dead_max_age * 1000)],
    )
    return bool(moved)


def parse_dead_record(raw: bytes | str) -> dict[str, Any]:
    """Split a ``dead_jobs`` value into its meta, queue and payload."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    meta_json, queue, payload = text.split("\n", 2)
    record: dict[str, Any] = json.loads(meta_json)
    record["queue"] = queue
    record["payload"] = payload
    return record
