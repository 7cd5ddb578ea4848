"""Bulk publishing: many jobs written in a few round trips, each one as a single publish.

Celery publishes one message per round trip: a ``group`` of 10,000 signatures, a
``chunks`` or a loop of ``delay`` waits for Redis 10,000 times. Here the jobs published
inside a :class:`Bulk` are not written when Kombu hands them to the channel: the
producer (``Enqueuer.put``) builds each job's script call as it would for a single
publish (:class:`Write`: the same script, keys, arguments and publish marker) and
adds it to the bulk, which sends them ``BULK_PIPELINE_SIZE`` at a time in one pipeline
(``Enqueuer.write``, the one way any job is written; a single publish is the case of
size one). The ways in:

* ``with celery_ext.bulk(app):`` around any publishes of the current thread (``delay``,
  ``apply_async``, ``send_task``, groups), in drop-in mode too: the transport buffers;
* ``celery_ext.apply_many(task, args_list, **options)`` (``task.apply_many`` under
  ``install(app)``): one bulk, one producer, the results in the order given;
* ``group(...).apply_async()`` (and ``chunks``, a chord's header) of an app with
  ``install(app)``: Celery's ``group._apply_tasks`` runs inside a bulk (:func:`batch_groups`);
* Kombu's ``Producer.batch()``: the channel's publish batch is a :class:`Bulk`.

What holds as for a single publish: priority, fair keys, countdown and eta (the
scheduled set), unique jobs (a unique job's ``AsyncResult`` names the pending job once
its bulk is written: ``UniqueRequest.settle``), ``before_task_publish`` and
``after_task_publish`` per message (Celery sends them around each publish, so
``after_task_publish`` means "handed to the bulk"), ``wait_replicas`` (one ``WAIT`` per
round trip), and exactly once: every job carries its publish marker, so a round trip
whose reply was lost is sent again whole under the retry policy (the app's
``task_publish_retry_policy``, else ``BULK_RETRY_POLICY``) and the jobs it wrote the
first time are no-ops the second. Redis runs a pipeline command by command: the longest
it is busy for a bulk is one job's script, whatever the bulk's size. ``apply_many``
keeps one round trip in flight: it sends a full buffer and reads its replies when the
next one is full (or at the end), building that one while Redis runs the first
(``Enqueuer.start`` and ``finish``); round trips still run one after the other, in order.

A bulk is written when its block ends, also when the block raises (what was published
before the error is written; Kombu's ``Producer.batch()`` discards instead, as Kombu
documents). A bulk's writes are buffered per thread (a context variable): other
threads publish as usual. On a cluster each job is written at once (a pipeline there
would be split per slot; not done yet).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import redis
from celery.local import Proxy

from celery_ext.config import BULK_PIPELINE_SIZE, BULK_RETRY_POLICY


@dataclass(slots=True)
class Write:
    """One job's write: a write script, its KEYS and ARGV, and what the producer does
    with the script's reply (``done``: unique holder, cluster hints, periodic outcome)."""

    script: str
    keys: list[str]
    args: list[Any]
    done: Callable[[Any], None] | None = None


class Writer(Protocol):
    """What a bulk writes through: ``Enqueuer.write`` (one round trip for ``writes``)."""

    def write(self, writes: Sequence[Write]) -> list[Any]: ...


_current: ContextVar[Bulk | None] = ContextVar("celery_ext_bulk", default=None)


def current_bulk() -> Bulk | None:
    """The bulk the current thread publishes into, if any."""
    return _current.get()


class Bulk:
    """Jobs published but not written yet, per writer (one per channel), sent
    ``size`` at a time. Also Kombu's publish-batch session (``Channel.create_publish_batch``:
    ``publish``, ``flush``, ``discard``, ``close``)."""

    def __init__(self, size: int = BULK_PIPELINE_SIZE, retry: bool = True,
                 retry_policy: Mapping[str, Any] | None = None, channel: Any = None,
                 overlap: bool = False) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"celery_ext: a bulk's size must be a whole number > 0, not {size!r}")
        self.size = size
        self.retry = retry
        self.retry_policy = {**BULK_RETRY_POLICY, **(retry_policy or {})}
        self.channel = channel
        self._pending: dict[int, tuple[Writer, list[Write]]] = {}
        #: Send a full buffer and read its replies when the next one is full (or at the
        #: flush), building the next while Redis runs it (``apply_many``'s direct path).
        self.overlap = overlap
        self._inflight: tuple[Writer, list[Write]] | None = None
        #: Jobs written so far and round trips made (read by tests and the bench).
        self.written = 0
        self.round_trips = 0

    def add(self, writer: Writer, write: Write) -> None:
        """Buffer one job's write; a full buffer is written at once. A round trip that
        failed (its retries spent) stays buffered and is sent again by the next flush:
        Kombu's publish retry then publishes only the job it was adding, again (a no-op
        if it is written: its marker is the same)."""
        entry = self._pending.get(id(writer))
        if entry is None:
            entry = self._pending[id(writer)] = (writer, [])
        entry[1].append(write)
        if len(entry[1]) >= self.size:
            if self.overlap:
                self._start(writer, entry[1][:self.size])
            else:
                self._write(writer, entry[1][:self.size])
            del entry[1][:self.size]

    def flush(self) -> None:
        """Write every buffered job, ``size`` per round trip; what a failed round trip
        left stays buffered."""
        self._settle()
        for key in list(self._pending):
            writer, writes = self._pending[key]
            while writes:
                self._write(writer, writes[:self.size])
                del writes[:self.size]
            del self._pending[key]

    def _start(self, writer: Writer, writes: list[Write]) -> None:
        """Send the round trip of ``writes`` without waiting for its replies (the one
        sent before is finished first: one round trip in flight, in order), or write it
        when the writer cannot (its connection busy, a cluster)."""
        self._settle()
        start = getattr(writer, "start", None)
        if start is not None and start(writes):
            self._inflight = (writer, writes)
        else:
            self._write(writer, writes)

    def _settle(self) -> None:
        """Read the replies of the round trip in flight. One whose replies did not come
        is sent again under the retry policy, as :meth:`_write` sends one; when that
        fails too its writes go back to the buffer, first."""
        if self._inflight is None:
            return
        writer, writes = self._inflight
        self._inflight = None
        try:
            try:
                writer.finish(writes)  # type: ignore[attr-defined]
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                    OSError):
                if not self.retry or self.retry_policy.get("max_retries") == 0:
                    raise
                self._pause(0)
                self._write(writer, writes, attempt=1)
                return
        except BaseException:
            entry = self._pending.setdefault(id(writer), (writer, []))
            entry[1][:0] = writes
            raise
        self.written += len(writes)
        self.round_trips += 1

    def _pause(self, attempt: int) -> None:
        policy = self.retry_policy
        time.sleep(min(float(policy["interval_start"])
                       + attempt * float(policy["interval_step"]),
                       float(policy["interval_max"])))

    def _write(self, writer: Writer, writes: list[Write], attempt: int = 0) -> None:
        """One round trip, sent again under the retry policy when the connection failed
        (the publish markers make it a no-op for what the failed attempt wrote);
        ``attempt``: the attempts made already."""
        if not writes:
            return
        max_retries = self.retry_policy.get("max_retries")
        while True:
            try:
                writer.write(writes)
                break
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                    OSError):
                if not self.retry or (max_retries is not None and attempt >= max_retries):
                    raise
                self._pause(attempt)
                attempt += 1
        self.written += len(writes)
        self.round_trips += 1

    # -- Kombu's publish-batch session (Producer.batch()) -------------------------------
    def publish(self, message: Any, **kwargs: Any) -> Any:
        return self.channel.basic_publish(message, _publish_batch=self, **kwargs)

    def discard(self) -> None:
        self._settle()  # (sent already: its replies are read, the connection freed)
        self._pending.clear()

    def close(self) -> None:
        self.discard()


def _retry_policy(app: Any) -> tuple[bool, Mapping[str, Any] | None]:
    conf = getattr(app, "conf", None)
    if conf is None:
        return True, None
    return bool(conf.task_publish_retry), conf.task_publish_retry_policy


@contextmanager
def bulk(app: Any = None, size: int = BULK_PIPELINE_SIZE) -> Iterator[Bulk]:
    """Write the jobs this thread publishes inside the block in round trips of ``size``
    jobs, when the block ends (see the module docstring). ``app`` gives the retry policy
    (``task_publish_retry``, ``task_publish_retry_policy``). A bulk inside a bulk is the
    outer one."""
    outer = _current.get()
    if outer is not None:
        yield outer
        return
    retry, policy = _retry_policy(app)
    buffer = Bulk(size, retry=retry, retry_policy=policy)
    token = _current.set(buffer)
    try:
        yield buffer
    finally:
        _current.reset(token)
        buffer.flush()


def _call_args(item: Any) -> tuple[Sequence[Any], Mapping[str, Any]]:
    if isinstance(item, Mapping):
        return (), item
    if isinstance(item, Sequence) and not isinstance(item, str | bytes):
        return item, {}
    raise TypeError(f"celery_ext: apply_many takes a tuple of positional arguments or a "
                    f"dict of keyword arguments per job, not a {type(item).__name__}")


def apply_many(task: Any, args_list: Iterable[Any], *, size: int = BULK_PIPELINE_SIZE,
               **options: Any) -> list[Any]:
    """``task.apply_async(args, **options)`` for each item of ``args_list`` (a tuple of
    positional arguments, or a dict of keyword arguments), written in round trips of
    ``size`` jobs; returns their ``AsyncResult``, in order, once every job is written.

    Each job's message is built by :class:`~celery_ext.producer.bulk_jobs.Jobs` (the
    direct path) when :func:`~celery_ext.producer.bulk_jobs.direct_path` allows it,
    else by ``apply_async``. The round trips are retried under the call's ``retry``
    and ``retry_policy`` over the app's."""
    from celery_ext.producer.bulk_jobs import Jobs, direct_path

    app = task._get_app()
    if isinstance(task, Proxy):  # a task of an app not finalized yet
        task = task._get_current_object()
    producer = options.pop("producer", None)
    retry, policy = _retry_policy(app)
    if options.get("retry") is not None:
        retry = bool(options["retry"])
    if options.get("retry_policy"):
        policy = {**(policy or {}), **options["retry_policy"]}
    with app.producer_or_acquire(producer) as producer:
        if direct_path(app, task, options, producer):
            outer = _current.get()  # a bulk inside a bulk is the outer one
            buffer = outer or Bulk(size, retry=retry, retry_policy=policy, overlap=True)
            jobs = Jobs(app, task, options, producer, buffer)
            try:
                return [jobs.publish(*_call_args(item)) for item in args_list]
            finally:
                if outer is None:
                    buffer.flush()
        with bulk(app, size):
            results = []
            for item in args_list:
                args, kwargs = _call_args(item)
                results.append(task.apply_async(args, kwargs, producer=producer, **options))
    return results


def task_apply_many(self: Any, args_list: Iterable[Any], **options: Any) -> list[Any]:
    """``task.apply_many(args_list, **options)``: :func:`apply_many` as a task method
    (``install(app)`` adds it to the app's task class)."""
    return apply_many(self, args_list, **options)


def batch_groups() -> None:
    """Make Celery's ``group`` publish its tasks in one bulk when its app has
    ``install(app)`` (Celery's ``group._apply_tasks`` publishes every signature with one
    producer; it runs inside :func:`bulk` here). Other apps' groups are unchanged."""
    from celery import canvas

    original = canvas.group._apply_tasks
    if getattr(original, "_celery_ext_bulk", False):
        return

    def _apply_tasks(self: Any, tasks: Any, producer: Any = None, app: Any = None,
                     *args: Any, **kwargs: Any) -> Iterator[Any]:
        the_app = app or self.app
        if not getattr(the_app, "_celery_ext_installed", False):
            yield from original(self, tasks, producer, app, *args, **kwargs)
            return
        with bulk(the_app):
            results = list(original(self, tasks, producer, app, *args, **kwargs))
        yield from results

    _apply_tasks._celery_ext_bulk = True  # type: ignore[attr-defined]
    canvas.group._apply_tasks = _apply_tasks
