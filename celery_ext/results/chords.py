"""Chords that cannot hang or run their body twice: the header counted by task id, in one
script per header result, on the group's slot.

Celery calls the backend at three moments of a chord: ``set_chord_size`` as it publishes
the header, ``apply_chord`` before that, and ``on_chord_part_return`` in the worker after
each header job stored its result. Each header result goes through ``chord_part.lua``
(``store/lua``): the chord's keys (``ResultKeys.chord_keys``) share the group's hash tag,
so the count is one atomic step on one node as on a cluster, without ``chord_unlock``.

- A header job run twice (its pool died after it stored its result, before the ack, and
  the job ran again elsewhere) counts once: the set of counted task ids decides.
- Exactly one caller is told to publish the body. If that caller's process dies before
  ``chord_done.lua`` settled the chord, its job is run again (the transport redelivers a
  dead pool's jobs) and the script tells the same task id again, which publishes the
  body again. That publish carries the chord's identity (``PUBLISH_ONCE``: the group id
  and when the chord was applied, with the body's task id): the enqueue script finds the
  first publish's marker, kept for the chord's expiry, and writes nothing. So the body is
  enqueued once even when its publisher died between the publish and ``chord_done``;
  a frozen chord applied again is a new apply, whose body is published anew.
- A header job that failed, was revoked, or ended in the dead set makes the chord fail
  through the body's error callbacks (Celery's ``chord_error_from_stack``) with the
  reason, once every header job was counted, as Celery does.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from celery import states
from celery.backends.base import _create_chord_error_with_cause
from celery.canvas import maybe_signature
from celery.exceptions import ChordError
from celery.result import GroupResult, allow_join_result
from celery.utils.functional import _regen
from celery.utils.log import get_logger

from celery_ext.config import DEFAULT_CHORD_EXPIRES
from celery_ext.producer.publish import PUBLISH_ONCE, PUBLISH_ONCE_TTL
from celery_ext.store.scripts import source

logger = get_logger(__name__)


class ChordCounting:
    """The chord half of :class:`~celery_ext.results.backend.ResultBackend`."""

    # What the backend class provides (Celery's Backend and ResultBackend).
    app: Any
    client: Any
    keys: Any
    expires: int
    encode: Any
    decode: Any
    encode_result: Any
    exception_to_python: Any
    chord_error_from_stack: Any

    # -- what Celery calls ------------------------------------------------------------

    def set_chord_size(self, group_id: str, chord_size: int) -> None:
        applied = self._script("chord_size")(keys=self.keys.chord_keys(str(group_id)),
                                             args=[int(chord_size), self._chord_ttl])
        with self.client.pipeline(transaction=False) as pipe:  # the index operators read
            pipe.zadd(self.keys.pending_chords, {str(group_id): int(applied)})
            pipe.expire(self.keys.pending_chords, self._chord_ttl)
            pipe.execute()

    def apply_chord(self, header_result_args: Any, body: Any, **kwargs: Any) -> None:
        # The body is recorded with the chord: a header job whose message cannot be read
        # (it went to the dead set undecodable) still fails its chord (dead_jobs.py).
        gid = str(header_result_args[0])
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hset(self.keys.chord(gid), "body", self.encode(dict(body)))
            pipe.expire(self.keys.chord(gid), self._chord_ttl)
            pipe.execute()
        # A header holding groups is saved, so the body gets its results nested as they
        # are (what Celery's Redis backend does); a flat header is read from the count.
        if isinstance(header_result_args[1], _regen):
            return
        header = self.app.GroupResult(*header_result_args)
        if any(isinstance(r, GroupResult) for r in header.results):
            self.client.set(self.keys.group(header.id),
                            self.encode({"result": header.as_tuple()}),
                            ex=self._chord_ttl)

    def chord_body(self, group_id: str) -> dict[str, Any] | None:
        """The body signature recorded for the chord of ``group_id`` (None: no chord)."""
        raw = self.client.hget(self.keys.chord(str(group_id)), "body")
        return dict(self.decode(raw)) if raw else None

    def add_to_chord(self, group_id: str, result: Any) -> None:
        self.client.hincrby(self.keys.chord(str(group_id)), "size", 1)

    def on_chord_part_return(self, request: Any, state: str, result: Any,
                             **kwargs: Any) -> None:
        tid, gid = request.id, request.group
        if not tid or not gid:
            return
        body = request.chord or self.chord_body(gid)
        if not body:
            return
        index = "+inf" if request.group_index is None else request.group_index
        encoded = self.encode(
            [1, tid, state, self.encode_result(result, state)])
        size = body.get("chord_size")
        counted, _size, claimed = self._script("chord_part")(
            keys=self.keys.chord_keys(gid),
            args=[tid, index, encoded, self._chord_ttl, "" if size is None else int(size)])
        if counted == -1 or not claimed:
            return
        callback = maybe_signature(body, app=self.app)
        try:
            values = self._header_values(gid)
        except ChordError as exc:
            logger.error("Chord %r failed: %s", gid, exc)
            self._settle(gid, "failed", str(exc))
            self.chord_error_from_stack(callback, exc)
            return
        except Exception as exc:  # Celery reports any join error so
            logger.exception("Chord %r: cannot read its header's results", gid)
            self._settle(gid, "failed", f"Join error: {exc!r}")
            self.chord_error_from_stack(
                callback, ChordError(f"Join error: {exc!r}"))
            return
        applied = self.client.hget(self.keys.chord(gid), "applied_at")
        once = {PUBLISH_ONCE: f"chord:{gid}:{int(applied or 0)}",
                PUBLISH_ONCE_TTL: self._chord_ttl}
        try:
            self.app.amqp._retry_publish(callback.apply_async, (values,), **once)
        except Exception as exc:  # any publish error fails the chord, as in Celery
            logger.exception("Chord %r: publishing its body failed", gid)
            self._settle(gid, "failed", f"Callback error: {exc!r}")
            self.chord_error_from_stack(
                callback, ChordError(f"Callback error: {exc!r}"))
            return
        self._settle(gid, "sent", "")

    # -- helpers ------------------------------------------------------------------------

    @property
    def _chord_ttl(self) -> int:
        expires = self.app.conf.get("result_chord_expires")
        if expires is None:
            return int(self.expires or DEFAULT_CHORD_EXPIRES)
        seconds = expires.total_seconds() if hasattr(expires, "total_seconds") else expires
        return int(seconds) or DEFAULT_CHORD_EXPIRES

    @cached_property
    def _scripts(self) -> dict[str, Any]:
        return {name: self.client.register_script(source(name))
                for name in ("chord_size", "chord_part", "chord_done")}

    def _script(self, name: str) -> Any:
        return self._scripts[name]

    def _settle(self, gid: str, state: str, reason: str) -> None:
        self._script("chord_done")(keys=self.keys.chord_keys(gid),
                                   args=[state, reason, self._chord_ttl])
        self.client.zrem(self.keys.pending_chords, gid)

    def pending_chords(self, limit: int = 100) -> list[dict[str, Any]]:
        """The chords not yet settled, oldest first: group id, header results counted of
        the header's size, when applied (seconds, Redis clock). Entries whose chord
        settled or expired are dropped from the index on the way."""
        ids = [i.decode() if isinstance(i, bytes) else str(i) for i in
               self.client.zrange(self.keys.pending_chords, 0, max(limit, 1) - 1)]
        if not ids:
            return []
        with self.client.pipeline(transaction=False) as pipe:
            for gid in ids:
                pipe.hmget(self.keys.chord(gid), ["size", "counted", "state", "applied_at"])
            rows = pipe.execute()
        out, gone = [], []
        for gid, (size, counted, state, applied) in zip(ids, rows, strict=True):
            if state != b"pending":
                gone.append(gid)
                continue
            out.append({"group_id": gid, "counted": int(counted or 0),
                        "size": int(size) if size is not None else None,
                        "applied_at": int(applied or 0) / 1000})
        if gone:
            self.client.zrem(self.keys.pending_chords, *gone)
        return out

    def _header_values(self, gid: str) -> list[Any]:
        """The header's results in header order; ChordError names a failed header job."""
        saved = GroupResult.restore(gid, app=self.app)
        if saved is not None:  # a nested header (apply_chord saved it): join it as it is
            saved.on_ready()
            with allow_join_result():
                return list(saved.join_native(
                    timeout=self.app.conf.result_chord_join_timeout, propagate=True))
        raw = self.client.zrange(self.keys.chord_results(gid), 0, -1)
        return [self._unpack(item) for item in raw]

    def _unpack(self, item: bytes) -> Any:
        _, tid, state, value = self.decode(item)
        if state in states.EXCEPTION_STATES:
            value = self.exception_to_python(value)
        if state in states.PROPAGATE_STATES:
            raise _create_chord_error_with_cause(
                message=f"Dependency {tid} raised {value!r}", original_exc=value)
        return value
