"""Prefetch accounting of a channel (Kombu's QoS), and when a fetch waits to take more.

Ownership lives in Redis (the in-flight record, written by the fetch script itself) and
in the worker pool of the process (what it holds: ``holdings.Holdings``); the QoS
counts what Kombu delivered and tells the pool of each ack, requeue and reject.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kombu.transport import virtual

if TYPE_CHECKING:
    from celery_ext.transport.channel import Channel


def fetch_waits(free: int, held: int, concurrency: int, batch: int) -> bool:
    """Whether a fetch for ``free`` prefetch slots waits: every execution slot has a job
    (``held`` >= ``concurrency``) and fewer than half the prefetch window (``free`` +
    ``held``), or a pool's worth if that is more, are free (at most ``batch``).

    Fetching several at once rather than one per finished job costs fewer round trips,
    fetch scripts and ack calls per job (the acks of the loop are written before each
    fetch); half the window rather than a pool's worth halves them again for a prefork
    pool at Celery's default multiplier (4): -c 2 fetched 2 of its 8 slots at a time.
    What is still held when the fetch goes out (half the window, at least a job per slot)
    keeps every slot busy while its reply comes back, and a slot that may be idle never
    waits for it."""
    want = max(concurrency, (free + held) // 2)
    return free < min(want, batch) and held >= concurrency


class QoS(virtual.QoS):
    """Prefetch accounting in memory; ownership lives in Redis (the in-flight record)
    and in the worker pool of the process (what it holds: ``holdings.Holdings``)."""

    restore_at_shutdown = True
    channel: Channel

    def append(self, message: Any, delivery_tag: str) -> None:
        # The fetch script already recorded the job as in flight, atomically.
        super().append(message, delivery_tag)
        self.channel.worker_pool.delivered(delivery_tag, message)

    def ack(self, delivery_tag: str) -> None:
        self.channel.worker_pool.ack([delivery_tag])
        super().ack(delivery_tag)
        self._credit_freed()

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:
            self.channel.worker_pool.requeue([delivery_tag])
        else:
            self.channel._dead_letter(delivery_tag, "rejected", "rejected by the consumer")
        super().ack(delivery_tag)
        self._credit_freed()

    def _credit_freed(self) -> None:
        """Wake a poll that waits for prefetch credit (``wakeup.WakePipe``)."""
        transport = self.channel.connection
        cycle = getattr(transport, "cycle", None)
        if cycle is not None:
            cycle.credit_freed()

    def restore_unacked(self, client: Any = None) -> list[Any]:
        """The channel closes: return nothing now, and let the pool reconcile before
        its next fetch.

        At this moment Celery still references every job it reserved; only after the
        channel closed does it drop those it will never run (a prefork pool's), while a
        threads pool still runs the ones it queued. The reconcile before the next fetch
        (or the return at shutdown) tells them apart: a job whose message is still
        referenced stays owned and is acked when it ends; the rest go back."""
        self._flush()
        self._delivered.clear()
        pool = self.channel._worker_pool
        if pool is not None:
            pool.needs_reconcile()
        return []

    def restore_visible(self, *args: Any, **kwargs: Any) -> None:
        """No visibility timeout: dead pools' jobs are requeued by the reaper."""

    def forget(self, delivery_tag: str) -> None:
        """Drop a tag from prefetch accounting only (Redis was already updated)."""
        super().ack(delivery_tag)
