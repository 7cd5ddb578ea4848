"""Kombu's retry sleep under ``-P gevent`` yields to the other greenlets.

A fresh interpreter patches as ``celery worker -P gevent`` does
(``celery.maybe_patch_concurrency``), so this test process stays unpatched. A greenlet
ticks every 50 ms while the main greenlet sleeps 0.5 s in ``kombu.utils.functional``'s
``sleep`` (the one ``retry_over_time`` uses between reconnect attempts): before
``cooperative_retry_sleep`` the ticker is frozen, after it the ticker runs.
"""

from __future__ import annotations

import subprocess
import sys

from tests.workers import REPO_ROOT

SCRIPT = """
import time

import celery

celery.maybe_patch_concurrency(["celery", "worker", "-P", "gevent"])
import gevent
from kombu.utils import functional

from celery_ext.worker.green import cooperative_retry_sleep

ticks = []


def tick():
    while True:
        ticks.append(time.monotonic())
        gevent.sleep(0.05)


def ticks_during_retry_sleep():
    ticker = gevent.spawn(tick)
    gevent.sleep(0)
    before = len(ticks)
    functional.sleep(0.5)
    ticker.kill()
    return len(ticks) - before


frozen = ticks_during_retry_sleep()
changed = cooperative_retry_sleep()
print(frozen, changed, ticks_during_retry_sleep(), cooperative_retry_sleep())
"""


def test_kombus_retry_sleep_lets_other_greenlets_run() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60, check=True)
    frozen, changed, ticks, again = done.stdout.split()
    # Changed only where gevent's patching had left the blocking sleep in place (it
    # does with gevent 25.9.1 and Celery 5.7.0); once changed, never twice.
    assert changed == str(frozen == "0"), done.stdout
    assert int(ticks) >= 5, done.stdout
    assert again == "False"


def test_an_unpatched_process_is_left_alone() -> None:
    from kombu.utils import functional

    from celery_ext.worker.green import cooperative_retry_sleep

    sleep = functional.sleep
    assert cooperative_retry_sleep() is False
    assert functional.sleep is sleep
