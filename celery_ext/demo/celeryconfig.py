"""Example Celery configuration using the celery_ext transport (the demo app's).

Load it with ``app.config_from_object("celery_ext.demo.celeryconfig")``. The broker
URL comes from ``CELERY_EXT_BROKER_URL`` (the demo sets it to an embedded server); results go
to the same server, db 1, over plain ``redis://``, unless ``CELERY_EXT_RESULT_BACKEND``
names another (a Redis Cluster has no db 1, and Celery's Redis backend does not speak
cluster: the cluster compose file gives results a server of their own).
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

broker_url = os.environ.get("CELERY_EXT_BROKER_URL", "celery-ext://127.0.0.1:6379/0")

_parts = urlsplit(broker_url)
_scheme = "rediss" if _parts.scheme == "celery-exts" else "redis"
result_backend = os.environ.get("CELERY_EXT_RESULT_BACKEND") or urlunsplit(
    (_scheme, _parts.netloc, "/1", _parts.query, ""))

# celery_ext settings (each also overridable by a CELERY_EXT_<NAME> environment variable).
broker_transport_options = {
    "namespace": "celery_ext",      # key prefix and Redis Cluster hash tag
    "heartbeat_interval": 5.0,      # seconds between a pool's heartbeats
    "dead_after": 30.0,             # a pool silent this long is dead: its jobs are requeued
    "reap_interval": 10.0,          # seconds between reaper passes (jittered)
    "max_recoveries": 3,            # a job that killed its worker more often goes to the dead set
}

broker_connection_retry_on_startup = True
# install(app) already defaults these two to True: a job is acked when it finishes,
# and a job whose prefork child died is returned to its queue.
task_acks_late = True
task_reject_on_worker_lost = True
task_track_started = True
worker_prefetch_multiplier = 4
result_expires = 24 * 3600
# Results also record the worker that ran the job (the demo shows where a killed
# pool's jobs ran again).
result_extended = True

# Periodic jobs: the worker pools enqueue each due run themselves (one of them, the
# holder of the periodic lease), exactly once; no `celery beat` to run
# (docs/periodic.md). Every 10 s, so that the demo shows runs soon after it starts.
beat_schedule = {
    "purge-sessions": {"task": "celery_ext.demo.app.purge_sessions", "schedule": 10.0},
}
