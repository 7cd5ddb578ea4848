"""Ack batching: the acks of jobs that finish close together go in one ``ack`` call.

A worker pool's acks (``WorkerPool.ack``) wait here until one writer takes them all, so
one ``ack`` script carries every tag pending when it is written (``AckSender`` then
sends it without waiting for the reply). Who writes depends on how the worker runs its
jobs; one of three modes applies to each ack:

* **event loop** (a prefork pool's results, a solo pool's jobs): an ack made in the
  loop's own thread waits, with those of the turns after it, until the loop sends its next
  fetch, which they make room for (``flush``), or finds nothing to fetch (an idle pool's
  next turn: no fetch would carry them, ``flush``), a timer of the loop fires
  ``LOOP_ACK_DELAY`` after the first of them, a turn finds ``LOOP_ACKS_PER_CALL`` of them
  waiting (``on_loop_tick``), or the loop runs a job in its own thread
  (``before_loop_job``: a solo pool). A prefork pool's main process sees each
  job's accept or result in a turn of its own: about one call per job without this, one
  per fetch with it;
* **threads** (a threads pool's jobs, and any thread not the loop's): the acking thread
  writes at once, unless another thread is writing: that one writes these too before it
  returns;
* **gevent** (no Kombu event loop: Celery's ``synloop``): the first job to ack spawns a
  greenlet, and it writes the acks of every job that finished before it ran.

Which thread calls each method:

==========================  ============================================================
``add``                     the thread acking a job (Kombu's ``QoS.ack``): the event
                            loop's, a thread of a threads pool, a job's greenlet
``flush``                   the consumer's thread before it sends a fetch, when it has
                            nothing to fetch, and at each tick; a reconcile; the writer
                            greenlet (gevent); ``add``'s thread
``on_loop_tick``            the event loop's thread, each turn before it polls
``_loop_ack_due``           the event loop's thread: the timer ``add`` set
``before_loop_job``         any process's thread starting a job (``task_prerun``)
``event_loop_gone``         the thread closing the event loop, or the one stopping the pool
==========================  ============================================================

Only one thread writes at a time (``_writing``); the others leave their tags to it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from celery_ext.config import LOOP_ACK_DELAY, LOOP_ACKS_PER_CALL

#: Most tags one coalesced ``ack`` call carries (more go in the next call).
MAX_ACKS_PER_CALL = 256

#: This process's id, renewed in a forked child: ``os.getpid`` is a system call, and the
#: loop's thread asks at each ack (a prefork pool's main process: about one per job).
_pid = os.getpid()


def _renew_pid_after_fork() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_renew_pid_after_fork)


class AckBatcher:
    """The acks made and not yet written, and who writes them (thread-safe).

    ``write`` sends one ``ack`` call for a batch of tags (``WorkerPool`` hands them to
    its ``AckSender``); ``green``: jobs are greenlets (``-P gevent``)."""

    def __init__(self, write: Callable[[list[str]], None], green: bool) -> None:
        self._write_batch = write
        self._green = green
        self._pending: list[str] = []
        self._lock = threading.Lock()
        #: A thread is writing the pending acks: others leave theirs to it.
        self._writing = False
        #: Notified when a thread stops writing acks (``flush(wait=True)``).
        self._idle = threading.Condition(self._lock)
        #: The event loop's thread while its ticks flush the pending acks (else None).
        self._loop_thread: int | None = None
        #: gevent: the writer greenlet is spawned and has not run yet.
        self._green_write_due = False
        #: The event loop (Kombu's hub) whose thread ``_loop_thread`` is, and its
        #: process: a forked child's copy of this batcher has no loop (its thread may
        #: carry the same id).
        self._loop: Any = None
        self._loop_pid = 0
        #: The loop's timer that writes its acks ``LOOP_ACK_DELAY`` after the first of
        #: them (set and cleared in the loop's thread only).
        self._loop_timer: Any = None

    def add(self, tags: list[str]) -> None:
        """Ack ``tags``: write them now, or leave them to the writer of this mode (see
        the module's docstring)."""
        with self._lock:
            self._pending += tags
            if self._writing or self._green_write_due:
                return
            if threading.get_ident() == self._loop_thread and _pid == self._loop_pid:
                if self._loop_timer is None:
                    # Armed while the loop handles events, so the poll that follows
                    # wakes for it: an idle loop writes its acks on time too.
                    self._loop_timer = self._loop.call_later(LOOP_ACK_DELAY,
                                                             self._loop_ack_due)
                return
            if self._green:
                self._green_write_due = True
                self._spawn_green_write()
                return
            self._writing = True
        self._write()

    def flush(self, wait: bool = False) -> None:
        """Write the pending acks now, unless a thread is writing them already; with
        ``wait``, also wait for that thread: the caller then knows every ack made
        before the call was written (shutdown returns what is left in the record)."""
        with self._lock:
            while wait and self._writing:
                self._idle.wait()
            if self._writing or not self._pending:
                return
            self._writing = True
        self._write()

    def on_loop_tick(self, loop: Any) -> None:
        """From the event loop ``loop`` (Kombu's hub), each turn before it polls: acks
        of its thread wait for the loop's writes from now on. Writes them now if
        ``LOOP_ACKS_PER_CALL`` wait. The loop's thread and process are noted at its first
        turn (and again after ``event_loop_gone``), not at every turn: a prefork pool's
        loop turns about twice per job."""
        if loop is not self._loop:
            self._loop, self._loop_pid = loop, _pid
            self._loop_thread = threading.get_ident()
        if len(self._pending) >= LOOP_ACKS_PER_CALL:
            self.flush()

    def before_loop_job(self) -> None:
        """A job starts: if it runs in the event loop's own thread (a solo pool), the
        acks the loop owes are written first, so none waits for a job's whole run."""
        if (self._pending and threading.get_ident() == self._loop_thread
                and _pid == self._loop_pid):
            self.flush()

    def _loop_ack_due(self) -> None:
        """The loop's timer: its oldest pending ack waited ``LOOP_ACK_DELAY``."""
        self._loop_timer = None
        self.flush()

    def event_loop_gone(self) -> None:
        """The event loop closed (or the pool stops): no tick will come, write acks at
        once again and write those pending, after any other thread's write under way."""
        self._loop_thread = self._loop = None
        timer, self._loop_timer = self._loop_timer, None
        if timer is not None:
            timer.cancel()
        self.flush(wait=True)

    def _spawn_green_write(self) -> None:
        """Start the greenlet that writes the pending acks. gevent runs it after the
        greenlets already runnable (jobs finishing in the same turn of its loop ack
        meanwhile), and not in the loop's own callback, where a socket write that
        waits is forbidden."""
        import gevent

        def write() -> None:
            with self._lock:
                self._green_write_due = False
            self.flush()

        gevent.spawn(write)

    def _write(self) -> None:
        """Write pending acks until none is left (the caller set ``_writing``)."""
        try:
            while True:
                with self._lock:
                    tags = self._pending[:MAX_ACKS_PER_CALL]
                    del self._pending[:MAX_ACKS_PER_CALL]
                    if not tags:
                        self._writing = False
                        self._idle.notify_all()
                        return
                self._write_batch(tags)
        except BaseException:
            with self._lock:
                self._writing = False
                self._idle.notify_all()
            raise
