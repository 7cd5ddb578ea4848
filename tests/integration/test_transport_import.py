"""Importing the transport only defines: what it sets up (the fair-key signal receiver)
is set up by the first transport a process makes, in time for its first publish."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import redis

from celery_ext.store.keys import Keys
from tests.helpers import REPO_ROOT

K = Keys("celery_ext")

#: A fresh drop-in producer: the test app without install(app), one publish of a task
#: with ``fair_by``; it says whether importing connected anything first.
PRODUCER = textwrap.dedent("""
    from celery import signals

    import celery_ext.transport

    print("receivers after import:", len(signals.before_task_publish.receivers))
    from tests.apps import proj_fair

    proj_fair.work.apply_async(("T", 1))
""")


def test_the_first_publish_of_a_fresh_drop_in_process_has_its_fair_key(
        broker_url: str, redis_client: redis.Redis) -> None:
    """``import celery_ext.transport`` connects no signal receiver; the process's first
    publish (drop-in: only the URL is ours) still goes to its fair key's sub-queue,
    because Celery makes the transport, which connects the receiver, before it sends
    ``before_task_publish``."""
    env = {**os.environ, "CELERY_EXT_BROKER_URL": broker_url, "CELERY_EXT_NO_INSTALL": "1",
           "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", PRODUCER], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "receivers after import: 0" in done.stdout
    assert redis_client.llen(K.fair_queue("celery", "T")) == 1
    assert redis_client.llen(K.queue("celery")) == 0
