"""What one process holds of its worker pool's in-flight record.

The record in Redis says what the pool fetched; ``Holdings`` says which of those jobs this
process can still finish, so a reconcile (``WorkerPool.reconcile``) returns the others and
keeps these. Called from every thread that delivers, acks or rejects a job, and from the
consumer's thread when it reconciles.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any


class Holdings:
    """What this process holds of its pool's in-flight record (thread-safe).

    A delivered message is held while it is referenced (weakly here): by a reserved
    or running request, by a queued thread-pool task, by Kombu. A message whose
    request Celery dropped is collected and so no longer held. Acks move a tag from
    "delivered" to "acking" until Redis confirms them; an ack whose outcome is not
    known (connection lost) moves to "replay", applied before anything is returned.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._messages: dict[str, weakref.ref[Any]] = {}  # insertion = delivery order
        self._acking: set[str] = set()
        self._replay: set[str] = set()

    def delivered(self, tag: str, message: Any) -> None:
        with self._lock:
            self._messages[tag] = weakref.ref(message)

    def acking(self, tags: list[str]) -> None:
        with self._lock:
            for tag in tags:
                self._messages.pop(tag, None)
                self._acking.add(tag)

    def confirmed(self, tags: list[str]) -> None:
        with self._lock:
            self._acking.difference_update(tags)
            self._replay.difference_update(tags)

    def unconfirmed(self, tags: list[str]) -> None:
        with self._lock:
            self._acking.difference_update(tags)
            self._replay.update(tags)

    def released(self, tags: list[str]) -> None:
        """The process is done with these (returned, dead-lettered, or given up)."""
        with self._lock:
            for tag in tags:
                self._messages.pop(tag, None)

    def acking_tags(self) -> list[str]:
        """Tags whose ack was made and not yet confirmed."""
        with self._lock:
            return sorted(self._acking)

    def to_replay(self) -> list[str]:
        with self._lock:
            return sorted(self._replay)

    def held(self) -> set[str]:
        """What the process holds now; forgets the messages nothing references."""
        with self._lock:
            gone = [t for t, ref in self._messages.items() if ref() is None]
            for tag in gone:
                del self._messages[tag]
            return set(self._messages) | self._acking | self._replay

    def delivery_order(self) -> list[str]:
        with self._lock:
            return list(self._messages)
