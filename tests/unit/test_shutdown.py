"""A warm shutdown starts at once, even while the worker's event loop has nothing to do.

Celery's SIGTERM handler only sets a flag that the event loop reads between turns, and
an idle pool of ours sends no fetch, so the loop's poll would sleep until its next timer
(up to 10 s in a worker). ``celery_ext.worker.bootsteps`` wakes the loop from a thread of its
own when Celery sends ``worker_shutting_down``. Here the loop is Kombu's real hub with a
worker's timer, the signal a real SIGALRM, the receiver the one Celery's handler reaches.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery.signals import worker_shutting_down
from kombu.asynchronous import Hub, get_event_loop, set_event_loop
from kombu.asynchronous.timer import Timer

from celery_ext.worker import bootsteps
from celery_ext.worker import worker_pool as _pool

#: A worker's hub polls at most this long (Celery's Timer bootstep, with an event loop).
WORKER_TIMER_MAX_INTERVAL = 10.0
#: The hub's next timer, which its poll waits for unless something wakes it.
FAR_TIMER = 6.0
#: A turn shorter than this ended before the timer was due.
WOKEN_WITHIN = 3.0
#: When the signal arrives, after the poll began.
SIGNAL_AFTER = 0.2


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    monkeypatch.setattr(_pool, "_pools", {})  # no pool of another test is marked stopping
    previous = get_event_loop()
    loop = Hub(timer=Timer(max_interval=WORKER_TIMER_MAX_INTERVAL))
    set_event_loop(loop)
    # A connection that stays silent: a hub with no reader sleeps 0.1 s instead of
    # polling (the worker's hub always has the broker's connections).
    silent, peer = socket.socketpair()
    loop.add_reader(silent, lambda *a: None)
    loop.call_later(FAR_TIMER, lambda: None)
    try:
        yield loop
    finally:
        set_event_loop(previous)
        loop.close()
        silent.close()
        peer.close()
        stopping, bootsteps._stopping = bootsteps._stopping, None
        if stopping is not None:
            stopping.join(5)


def _send_like_celery(signum: int, frame: Any) -> None:
    """What Celery's warm shutdown handler sends, from inside the signal handler."""
    worker_shutting_down.send(sender="celery@test", sig="SIGTERM", how="Warm", exitcode=0)


def _turn_with_shutdown_signal(hub: Hub) -> float:
    """Seconds one loop turn takes (it fires no timer, then polls) when the shutdown
    signal arrives ``SIGNAL_AFTER`` into it."""
    turn = hub.create_loop()
    previous = signal.signal(signal.SIGALRM, _send_like_celery)
    try:
        signal.setitimer(signal.ITIMER_REAL, SIGNAL_AFTER)
        t0 = time.monotonic()
        next(turn)
        return time.monotonic() - t0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_shutdown_signal_ends_an_idle_loop_turn(hub: Hub) -> None:
    took = _turn_with_shutdown_signal(hub)
    # Without the wake the poll lasts until the timer (6 s); with it, the turn ends right
    # after the signal (0.2 s), which leaves a loaded machine plenty of room.
    assert bootsteps._stopping is not None, "the receiver did not run"
    assert took < WOKEN_WITHIN, f"the loop slept {took:.1f}s past the shutdown signal"


def test_without_the_receiver_the_loop_sleeps_until_its_poll_ends(hub: Hub) -> None:
    """The other half of the evidence: the same turn with our receiver disconnected polls
    until its timer (so the test above measures the wake, not a short poll)."""
    assert worker_shutting_down.disconnect(bootsteps._on_shutting_down)
    try:
        took = _turn_with_shutdown_signal(hub)
    finally:
        worker_shutting_down.connect(bootsteps._on_shutting_down, weak=False)
    assert took >= WOKEN_WITHIN, f"the loop's turn ended after {took:.1f}s without a wake"
