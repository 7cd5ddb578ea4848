"""The fetch round trip: one ``fetch`` script call (``store/lua/fetch.lua``) instead of
Kombu's ``BRPOP``.

The worker pool's weighted round-robin (``readiness.ReadyQueues``) picks up to
``fetch_batch`` candidate queues among those believed non-empty; the script pops one
job per candidate and records it in the pool's in-flight hash in the same atomic step
(or, for a no-ack queue, only pops it). In the event loop the call is sent on the
channel's own connection and its reply read when that connection is readable
(Kombu's ``_brpop_start``/``_brpop_read``); ``basic_get`` and ``_get`` run it at once.
A job whose task id is revoked is not delivered: the script moves it to the dead set,
and its result is marked revoked here (``worker/control.mark_revoked``).
The reply says which queues were empty, blocked (paused, at their max_concurrency) or
rate-limited: the channel stops fetching from them until a wake-up or a timer says
otherwise (``wakeup.py``).

A fetched job that cannot be delivered is dead-lettered, not dropped: one too large,
one whose JSON, envelope or body does not decode, one the consumer's handler fails on.

One event per ``drain_events`` call, as Kombu documents: a reply read inside
``Connection.drain_events`` (a plain Kombu consumer, Celery's loop without an event loop)
delivers its first job and keeps the rest in the channel (:class:`Kept`), and the next
calls hand them out one each without a round trip. An event loop (Celery's hub) gets
every job of a reply at once. Either way a fetch still takes up to ``fetch_batch``.
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import suppress
from queue import Empty
from time import monotonic
from typing import TYPE_CHECKING, Any

import redis
from kombu.utils.encoding import bytes_to_str

from celery_ext.config import Settings
from celery_ext.errors import CONNECTION_ERRORS
from celery_ext.store.compact import unpack
from celery_ext.store.dead_set import dead_letter
from celery_ext.store.envelope import envelope_problem
from celery_ext.store.keys import Keys
from celery_ext.store.probe import gone_silent
from celery_ext.text import one_line
from celery_ext.transport.qos import fetch_waits
from celery_ext.worker.control import mark_revoked

if TYPE_CHECKING:
    from celery_ext.transport.channel import Channel

logger = logging.getLogger("celery_ext.transport.fetch")


def fetch_call(keys: Keys, settings: Settings, pool_id: str, queues: list[str],
               flags: str) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of one ``fetch`` call on the copy ``keys``: up to one job from each
    of ``queues`` for ``pool_id`` ("-": none tracked), ``flags`` a "1" (tracked) or "0"
    (no-ack) per queue."""
    return (keys.fetch(pool_id, queues, settings.priority_steps),
            [pool_id, flags, *queues, settings.max_payload_bytes, int(settings.job_index),
             settings.dead_max_size, int(settings.dead_max_age * 1000), keys.unique(""),
             keys.cursor_prefix])


def body_problem(channel: Any, raw: dict[str, Any]) -> str | None:
    """Kombu decodes the body while building the Message, where an exception stops
    the worker: try it here first (truncated base64, unknown body_encoding).
    ``channel``: what has Kombu's ``codecs`` and ``decode_body``."""
    body, encoding = raw.get("body"), raw["properties"].get("body_encoding")
    if not body or not encoding or encoding.lower() == "utf-8":
        return None
    if encoding not in channel.codecs:
        return f"its body_encoding {encoding!r} is unknown"
    try:
        channel.decode_body(body, encoding)
    except Exception as exc:
        return f"its body is not valid {encoding} ({type(exc).__name__}: {exc})"
    return None


class Kept:
    """A fetched job that a ``drain_events`` call did not deliver: kept by the channel
    for the next call. While it lives the worker pool counts its job as held (the pool
    keeps weak references), so a reconcile never returns a job the channel is about to
    deliver; dropped with a closing channel, the job goes back with the next reconcile."""

    __slots__ = ("__weakref__", "queue", "raw")

    def __init__(self, raw: dict[str, Any], queue: str) -> None:
        self.raw = raw
        self.queue = queue


class Fetcher:
    """The fetches of one channel: sent, read, decoded and delivered (or dead-lettered)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        #: A tracked fetch was sent and its reply not read yet.
        self.pending = False
        #: Fetched jobs that ``drain_events`` calls deliver, one per call, before fetching.
        self.kept: deque[Kept] = deque()

    # -- the worker pool's count of fetches on the wire -----------------------------------
    def _sent(self) -> None:
        self.pending = True
        self.channel.worker_pool.fetch_sent()

    def drop_kept(self) -> None:
        """The channel closes: its kept jobs are no longer held (the pool reconciles)."""
        self.kept.clear()

    def finished(self, lost: bool) -> None:
        """A tracked fetch's reply was read, or the connection it was on failed (the
        script may have run: its jobs are in the record, never delivered)."""
        if self.pending:
            self.pending = False
            self.channel.worker_pool.fetch_done(lost=lost)

    # -- at once: basic_get, _get ------------------------------------------------------
    def get(self, queue: str, no_ack: bool) -> Any:
        """Kombu's ``basic_get``: one job of ``queue`` as a Message, or None."""
        channel = self.channel
        jobs = self.fetch_now([queue], track=not no_ack)
        if not jobs:
            return None
        qname, tag, payload, rec = jobs[0]
        raw = self.decode(qname, tag, payload, rec, tracked=not no_ack)
        if raw is None:
            return None
        message = channel.Message(raw, channel=channel)
        if not no_ack:
            channel.qos.append(message, message.delivery_tag)
        return message

    def get_raw(self, queue: str) -> dict[str, Any]:
        """Kombu's ``_get``: one job of ``queue``, untracked, or Empty."""
        jobs = self.fetch_now([queue], track=False)
        for qname, tag, payload, rec in jobs:
            raw = self.decode(qname, tag, payload, rec, tracked=False)
            if raw is not None:
                return raw
        raise Empty()

    def fetch_now(self, queues: list[str], track: bool) -> list[Any]:
        """Fetch one job from each of ``queues``: the jobs of the reply. A pool the
        reaper declared dead registers again and fetches once more."""
        channel = self.channel
        pool_id = channel.pool_id if track else "-"
        flags = ("1" if track else "0") * len(queues)
        with channel.conn_or_acquire() as client:
            for _ in range(2):
                if track:
                    channel.worker_pool.fetch_sent()
                try:
                    status, jobs, *_ = channel.topology.fetch(client, pool_id, queues, flags)
                except BaseException:
                    if track:
                        channel.worker_pool.fetch_done(lost=True)
                    raise
                if track:
                    channel.worker_pool.fetch_done()
                if status:
                    return list(jobs)
                channel.worker_pool.revive()
                if jobs:  # on a cluster, other queues' copies gave jobs meanwhile
                    return list(jobs)
        return []

    # -- in the event loop: Kombu's _brpop_start and _brpop_read -----------------------
    def start(self) -> None:
        """Send one fetch (instead of BRPOP) for up to the free prefetch slots; first
        make the pool's in-flight record match what the process holds, if needed."""
        channel = self.channel
        while self.kept:  # (an event loop after drain_events calls: all of them now)
            self.deliver_kept()
        pool = channel._worker_pool
        if pool is not None:
            pool.describe_consumed()  # only when the consumers changed
            try:
                pool.maybe_reconcile()
            except CONNECTION_ERRORS as exc:
                # The pool's own connection failed. Fetching goes on (what is not yet
                # reconciled stays owned); the fetch itself says if Redis is gone, and
                # the reconcile is tried again before a later fetch.
                logger.debug("celery_ext: reconcile before fetch failed (%s)", exc)
        ready = channel._ready
        if not ready.has_active():
            # Idle: the WAKE listener and the ready refresh take over. No fetch will
            # carry the acks the loop made: written now, not when the loop's timer
            # fires (LOOP_ACK_DELAY later), so they do not meet the next job's wake-up.
            if pool is not None:
                pool.flush_acks()
            return
        settings = channel.settings
        credit = channel.qos.can_consume_max_estimate()
        n = settings.fetch_batch if credit is None else min(credit, settings.fetch_batch)
        if n <= 0:
            return
        # Held: delivered and not acked (Kombu keeps an acked tag in ``_delivered``, as
        # "dirty", until the next delivery).
        held = len(channel.qos._delivered) - len(channel.qos._dirty)
        if fetch_waits(n, held, channel.fetch_min, settings.fetch_batch):
            return
        if pool is not None:
            # The acks the loop made wait for this: written before the fetch they make
            # room for, the record never holds more than the prefetch window, and a
            # queue's concurrency limit counts no finished job (ack_batcher.py).
            pool.flush_acks()
        picks = ready.take(n)
        no_ack = channel._no_ack_queues
        flags = "".join("0" if q in no_ack else "1" for q in picks)
        pool_id = channel.pool_id if "1" in flags else "-"
        conn = channel.client.connection
        channel._in_poll = conn
        ready.fetch_sent()
        channel._brpop_sent_at = monotonic()
        if pool_id != "-":
            self._sent()
        channel.topology.send_fetch(conn, pool_id, picks, flags, lost=self._not_sent)

    def _not_sent(self) -> None:
        """The fetch failed before it was on the channel's connection: no reply comes."""
        self.channel._in_poll = None
        self.channel._ready.fetch_lost()
        self.finished(lost=True)

    def read(self, **options: Any) -> bool:
        """Read the reply of the fetch on the wire and deliver its jobs; Empty when none
        was delivered."""
        channel = self.channel
        conn = channel.client.connection
        pending = channel._in_poll
        try:
            try:
                reply = channel.topology.read_fetch(conn, **options)
            except channel.connection_errors:
                conn.disconnect()
                channel._ready.fetch_lost()
                self.finished(lost=True)
                raise
            except redis.exceptions.NoScriptError:
                # The server restarted and lost its script cache: load and go on.
                channel._ready.fetch_replied(())
                self.finished(lost=False)
                with channel.conn_or_acquire() as client:
                    channel.scripts.load_all(client)
                raise Empty() from None
            self.finished(lost=False)
        finally:
            channel._in_poll = None
        if not pending:
            channel._ready.fetch_replied(())
            raise Empty()
        status, jobs, empties, blocked, waits, *dropped = reply
        self._replied(empties, blocked, waits)
        if dropped:
            mark_revoked([bytes_to_str(i) for i in dropped[0]])
        if not status:
            # A reaper declared this pool dead while it was stopped; register again.
            # (On a cluster the copies that did not refuse it may have given jobs.)
            channel.worker_pool.revive()
            if not jobs:
                raise Empty()
        if not self._deliver(jobs):
            raise Empty()
        return True

    def _replied(self, empties: list[Any], blocked: list[Any],
                 waits: list[Any]) -> None:
        """What a reply says of its queues: empty ones wait for a wake-up; paused ones
        and those at their max_concurrency too (resume and ack publish one);
        rate-limited ones for a timer."""
        channel = self.channel
        ready = channel._ready
        replied = ready.fetch_replied([bytes_to_str(n) for n in (*empties, *blocked)])
        if empties:
            found = channel.topology.emptied([bytes_to_str(n) for n in empties])
            if found:
                ready.woken(found)
        if waits:
            channel.wakeups.throttle([(bytes_to_str(q), int(us) / 1e6) for q, us in waits])
        if replied:
            # Which of these "empty" replies predate the (re)subscription is unknown:
            # the ready set, read now that we are subscribed, says which hold jobs.
            try:
                channel.wakeups.refresh_ready()
            except channel.connection_errors:
                # The jobs of this reply are ours already: deliver them; fetch from
                # every queue until the next refresh.
                logger.debug("celery_ext: ready refresh failed, will retry", exc_info=True)
                ready.activate_all()

    def _deliver(self, jobs: list[Any]) -> bool:
        """Hand the reply's jobs to Kombu (inside ``drain_events``, the first one and
        keep the rest); whether any was delivered."""
        channel = self.channel
        no_ack = channel._no_ack_queues
        decoded: list[Kept] = []
        for qname, tag, payload, rec in jobs:
            queue = bytes_to_str(qname)
            raw = self.decode(qname, tag, payload, rec, tracked=queue not in no_ack)
            if raw is not None:
                decoded.append(Kept(raw, queue))
        one_event = getattr(channel.connection.cycle, "draining", False)
        delivered = False
        for i, job in enumerate(decoded):
            if delivered and one_event:
                self._keep(decoded[i:])
                break
            delivered = self._deliver_one(job) or delivered
        return delivered

    def _keep(self, jobs: list[Kept]) -> None:
        no_ack = self.channel._no_ack_queues
        for job in jobs:
            if job.queue not in no_ack:
                self.channel.worker_pool.delivered(job.raw["properties"]["delivery_tag"], job)
        self.kept.extend(jobs)

    def deliver_kept(self) -> bool:
        """Deliver the next kept job (one the dead set took is skipped); whether one was."""
        while self.kept:
            if self._deliver_one(self.kept.popleft()):
                return True
        return False

    def _deliver_one(self, job: Kept) -> bool:
        channel = self.channel
        try:
            channel.connection._deliver(job.raw, job.queue)
        except CONNECTION_ERRORS:
            # The rest of this fetch is in the record, never delivered.
            channel.worker_pool.needs_reconcile()
            raise
        except Exception as exc:
            # The consumer failed on this job (a message Celery does not catch as
            # invalid, e.g. without an id header): as a KeyError it would restart
            # the consumer and refetch the job forever, as anything else stop the
            # worker, and the rest of this fetch would stay undelivered.
            self._dead_letter_broken(job.raw, job.queue, exc)
            return False
        return True

    def check_reply(self) -> None:
        """Raise a connection error when a fetch's connection has gone silent: its reply
        is overdue while the server answers a fresh connection (``probe.gone_silent``),
        or unanswered for ``reply_timeout``. Such a connection is gone without a reset
        (half-open), and nothing else would notice. The consumer then reconnects (one
        log line) and its pool returns what the lost fetch may have moved."""
        channel = self.channel
        conn = channel._in_poll
        timeout = channel.settings.reply_timeout
        if not conn or not gone_silent(conn, channel._brpop_sent_at, timeout):
            return
        channel._in_poll = None
        with suppress(Exception):
            conn.disconnect()  # (so closing the channel does not wait for the reply)
        channel._ready.fetch_lost()
        self.finished(lost=True)
        raise redis.exceptions.ConnectionError(
            f"celery_ext: no reply to a fetch in {monotonic() - channel._brpop_sent_at:.0f}s: "
            "its connection is silent")

    # -- decoding, and what cannot be delivered -----------------------------------------
    def decode(self, qname: Any, tag: Any, payload: Any, rec: Any,
               tracked: bool = True) -> dict[str, Any] | None:
        """Parse a fetched job; an undecodable or oversized one goes to the dead set, not
        the floor. ``payload`` is the job's size (an int) when fetch left it in Redis
        because it is over ``max_payload_bytes``; ``tracked``: fetched into the pool's
        in-flight record (else, a no-ack fetch, the dead record is written from here)."""
        channel = self.channel
        queue, tag = bytes_to_str(qname), bytes_to_str(tag)
        if tracked:
            channel.topology.fetched(tag, queue)
        limit = channel.settings.max_payload_bytes
        if isinstance(payload, int) or (limit and len(payload) > limit):
            size = payload if isinstance(payload, int) else len(payload)
            error = f"the message is {size:,} bytes, over max_payload_bytes ({limit:,})"
            logger.error("celery_ext: job %s in job queue %r is too large (%s); moved to the "
                         "dead set", one_line(tag), queue, error)
            self._dead_letter_fetched(tag, queue, payload, tracked, "too_large", error)
            return None
        try:
            raw = unpack(payload, queue)  # the message the stored (compact) payload stands for
            problem = envelope_problem(raw) or body_problem(channel, raw)
            if problem is not None:
                raise ValueError(problem)
            props = raw["properties"]
            props["delivery_tag"] = tag
            info = props.setdefault("delivery_info", {})
        except Exception as exc:
            logger.error("celery_ext: undecodable message in job queue %r (%s: %s); "
                         "moved to the dead set", queue, type(exc).__name__,
                         one_line(str(exc)))
            self._dead_letter_fetched(tag, queue, payload, tracked, "undecodable",
                                      f"{type(exc).__name__}: {exc}")
            return None
        if int(rec) >= 0:
            info["redelivered"] = True
            headers = raw.get("headers")
            if isinstance(headers, dict):
                headers["redelivered"] = True
        return raw

    def _dead_letter_fetched(self, tag: str, queue: str, payload: Any, tracked: bool,
                             reason: str, error: str) -> None:
        """Dead-letter a job ``decode`` refused: from the in-flight record if fetch put
        it there, else (no-ack) from the payload in hand, so it is not lost either way."""
        channel = self.channel
        if tracked:
            self.dead_letter(tag, reason, error)
        elif not isinstance(payload, int):
            with channel.conn_or_acquire() as client:
                dead_letter(client, channel.settings, "-", tag, reason=reason, error=error,
                            fallback=queue.encode() + b"\n" + payload,
                            keys=channel.keys.of(queue))

    def _dead_letter_broken(self, raw: dict[str, Any], queue: str, exc: Exception) -> None:
        tag = raw["properties"]["delivery_tag"]
        error = one_line(f"{type(exc).__name__}: {exc}")
        headers = raw.get("headers") or {}
        name = headers.get("task") if isinstance(headers.get("task"), str) else None
        if self.dead_letter(tag, "invalid", error, name=name):
            logger.error("celery_ext: message %s in job queue %r moved to the dead set "
                         "(invalid: %s)", one_line(str(tag)), queue, error)
        self.channel.qos.forget(tag)

    def dead_letter(self, tag: str, reason: str, error: str, **meta: Any) -> bool:
        """Move one in-flight job of this pool to the dead set (see
        ``store.dead_set.dead_letter``)."""
        channel = self.channel
        pool = channel.worker_pool
        # Acked at start (acks_late off), the job is out of the record: its queue is the
        # fallback's. (Looked up before the release, while the record knows its queue.)
        fallback = meta.get("fallback")
        queue = fallback.partition("\n")[0] if isinstance(fallback, str) and "\n" in fallback \
            else None
        copy = channel.topology.copy_of(tag, queue)
        pool.holdings.released([tag])
        try:
            return dead_letter(pool.client, channel.settings, pool.pool_id, tag,
                               reason=reason, error=error, keys=copy, **meta)
        except CONNECTION_ERRORS:
            pool.needs_reconcile()  # not held anymore: returned to its queue instead
            raise
