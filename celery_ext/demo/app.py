"""The example app: ``celery -A celery_ext.demo.app worker`` runs its jobs.

Two lines turn a Celery app into a celery_ext app: a ``celery-ext://`` broker URL (in
:mod:`celery_ext.demo.celeryconfig`) and ``celery_ext.install(app)``. Its jobs:

- ``send_notice``: a short job (weight 5: its queue is picked five times as often);
- ``build_report``: a long job that checks in with progress and stops cleanly when
  its worker shuts down or someone asks it to; resumable: after its pool is killed it
  goes on from its last step (its cursor) instead of starting over;
- ``sync_account``: a flaky job that retries with backoff and, when it keeps
  failing, ends in the dead set, from where a person can retry it;
- ``refresh_cache``: a unique job (a duplicate enqueued while one is pending is dropped);
- ``call_partner_api``: a rate-limited job (Celery's ``rate_limit``);
- ``purge_sessions``: a periodic job (the config's ``beat_schedule``), enqueued by the
  worker pools themselves, no ``celery beat``.

It ships in the wheel, so ``python -m celery_ext.demo`` runs it from any folder; a
checkout's ``tasks`` package is this app under a shorter name.
"""

from __future__ import annotations

import random
import time
from typing import Any

from celery import Celery

import celery_ext

app = Celery("demo")
app.config_from_object("celery_ext.demo.celeryconfig")
celery_ext.install(app)


class TransientError(Exception):
    """A failure worth retrying (a timeout talking to some other service)."""


@app.task(weight=5)
def send_notice(user_id: int) -> str:
    """A short job: one per user, many of them."""
    time.sleep(0.05)
    return f"notice sent to user {user_id}"


@app.task(bind=True, weight=1, stall_after=30)
def build_report(self: Any, report_id: int, steps: int = 20, step_seconds: float = 0.25) -> dict:
    """A long job: checks in after each step, with the step as its cursor, so a run after
    its pool died resumes after the last step it did; stops early when told to."""
    resumed_from = self.cursor or 0
    for step in range(resumed_from + 1, steps + 1):
        time.sleep(step_seconds)
        if self.checkin(message=f"step {step}/{steps}", progress=step / steps, cursor=step):
            return {"report_id": report_id, "stopped_at_step": step}
    return {"report_id": report_id, "steps": steps, "resumed_from": resumed_from}


@app.task(bind=True, autoretry_for=(TransientError,), max_retries=3,
          retry_backoff=0.5, retry_backoff_max=4, retry_jitter=True)
def sync_account(self: Any, account_id: int, fail_rate: float = 0.5) -> str:
    """A flaky job: fails at random; after 3 retries it lands in the dead set."""
    if random.random() < fail_rate:
        raise TransientError(f"account {account_id}: upstream timed out")
    return f"account {account_id} synced"


@app.task(unique=True)
def refresh_cache(key: str) -> str:
    """A unique job: enqueuing it again while one for the same key is pending is a
    no-op (the caller gets the pending job's id)."""
    time.sleep(0.5)
    return f"cache {key} refreshed"


@app.task(rate_limit="2/s")
def call_partner_api(request_id: int) -> str:
    """A rate-limited job: Celery's ``rate_limit`` option, at most 2 starts a second."""
    time.sleep(0.05)
    return f"partner request {request_id} answered"


@app.task
def purge_sessions() -> str:
    """A periodic job (``beat_schedule``): one run per due time, whichever pools live."""
    time.sleep(0.05)
    return "expired sessions purged"
