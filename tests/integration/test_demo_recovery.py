"""The demo's recovery view (``celery_ext.demo.recovery``) follows a job of a killed pool
until it ran again, also when its first run had already stored its result: Celery's Redis
backend keeps a SUCCESS rather than overwrite it, so the rerun shows only in the job
index (done after the kill, by another pool).

Real server, a real ``celery worker`` (threads) for the rerun; the killed pool is one that
never heartbeats, as a SIGKILLed pool looks once reaped.
"""

from __future__ import annotations

from typing import Any

import redis

from celery_ext.client import Client
from celery_ext.demo.recovery import Recovery
from celery_ext.demo.show import Out
from celery_ext.store.clock import now_ms
from tests.apps import proj
from tests.helpers import wait_for


def test_a_rerun_whose_first_result_celery_keeps_is_seen_in_the_job_index(
        broker_url: str, redis_client: redis.Redis, worker_factory: Any) -> None:
    proj.configure(broker_url)
    app = proj.app
    admin = Client.from_app(app)
    job = proj.add.apply_async((2, 3))
    # Its first run finished on the pool that is then killed: the result is stored, the
    # ack never written (the job goes back to its queue, as the reaper's requeue leaves it).
    app.backend.store_result(job.id, 5, "SUCCESS")
    recovery = Recovery(admin, "pool-killed", "demo-b", now_ms(redis_client),
                        {"tag-1": (job.id, proj.add.name)})
    recovery.note_results(app)
    assert recovery.before[job.id] is not None
    out = Out([], tty=False)
    recovery.poll(app, out)
    assert not recovery.done  # queued: not run again yet

    worker = worker_factory("tests.apps.proj", pool="threads", concurrency=2,
                            hostname="survivor@%h").start()

    def recovered() -> bool:
        recovery.poll(app, out)
        return recovery.done

    wait_for(recovered, 20, "the rerun seen through the job index")
    assert recovery.finished == {"tag-1": "survivor"}
    assert any("ran on survivor (its first run had finished before the kill" in line
               for line in out.events), out.events
    assert app.AsyncResult(job.id).date_done == recovery.before[job.id]  # Celery kept it
    worker.stop()
