"""A production Celery configuration for an app on celery-ext: copy it beside your app and
load it with ``app.config_from_object("celeryconfig")``.

``broker_transport_options`` names every celery-ext setting with its default, so that
what a worker runs with can be read in one place; change a value here, or set the
environment variable named beside it (``CELERY_EXT_<NAME>``), which wins over this file.
docs/settings.md says what each does. tests/integration/test_deploy_config.py checks that
this file names every setting with its current default: a new or changed setting fails
that test until the file says it too.

The broker and result URLs come from the environment (a URL holds the password); results
go to celery-ext's result backend on the same servers, db 1 (docs/results.md).
"""

from __future__ import annotations

import os

broker_url = os.environ.get("CELERY_EXT_BROKER_URL", "celery-ext://127.0.0.1:6379/0")
result_backend = os.environ.get("CELERY_EXT_RESULT_BACKEND", "celery-ext://127.0.0.1:6379/1")

broker_transport_options = {
    # -- where the keys live ----------------------------------------------------------------
    # CELERY_EXT_NAMESPACE: prefix of every key and channel, and the Redis Cluster hash tag.
    "namespace": "celery_ext",
    # CELERY_EXT_GLOBAL_KEYPREFIX: Kombu's key prefix before everything ("" = none); apps
    # sharing one server with different prefixes never see each other's jobs.
    "global_keyprefix": "",
    # CELERY_EXT_CLUSTER: the broker is a Redis/Valkey Cluster (docs/cluster.md).
    "cluster": False,
    # -- worker pools: liveness and recovery ---------------------------------------------
    # CELERY_EXT_HEARTBEAT_INTERVAL: seconds between two heartbeats of a worker pool.
    "heartbeat_interval": 5.0,
    # CELERY_EXT_DEAD_AFTER: a pool silent this long (Redis time) is dead and its jobs are
    # requeued; at least twice heartbeat_interval.
    "dead_after": 30.0,
    # CELERY_EXT_REAP_INTERVAL: seconds between two reaper passes in each pool (jittered).
    "reap_interval": 10.0,
    # CELERY_EXT_MAX_RECOVERIES: a job recovered from dead pools more often than this goes
    # to the dead set (a poison pill).
    "max_recoveries": 3,
    # CELERY_EXT_IDLE_REFRESH_INTERVAL: an idle pool re-reads which queues hold jobs this
    # often (its only idle command), in case a wake-up was missed.
    "idle_refresh_interval": 1.0,
    # -- fetching -------------------------------------------------------------------------
    # CELERY_EXT_DEFAULT_WEIGHT: weight of a job queue whose task sets none.
    "default_weight": 1,
    # CELERY_EXT_FETCH_BATCH: most jobs one fetch round trip moves into a pool's in-flight.
    "fetch_batch": 16,
    # CELERY_EXT_PRIORITY_STEPS: priority levels of a job queue (0-9, lower runs first).
    "priority_steps": (0, 3, 6, 9),
    # -- the dead set ---------------------------------------------------------------------
    # CELERY_EXT_DEAD_MAX_SIZE: the dead set keeps at most this many jobs (oldest first out)...
    "dead_max_size": 10000,
    # CELERY_EXT_DEAD_MAX_AGE: ...and none older than this many seconds (180 days).
    "dead_max_age": 15552000.0,
    # -- scheduled jobs and retries -------------------------------------------------------
    # CELERY_EXT_PROMOTE_INTERVAL: longest an idle requeuer waits between promote passes.
    "promote_interval": 5.0,
    # CELERY_EXT_PROMOTE_MIN_INTERVAL: shortest gap between two promote passes of a pool.
    "promote_min_interval": 0.02,
    # CELERY_EXT_PROMOTE_BATCH: most due jobs one promote call moves to their queues.
    "promote_batch": 100,
    # CELERY_EXT_RETRY_BACKOFF_BASE: first delay (s) of the opt-in backoff (backoff=True)...
    "retry_backoff_base": 2.0,
    # CELERY_EXT_RETRY_BACKOFF_MAX: ...doubled per attempt up to this many seconds...
    "retry_backoff_max": 3600.0,
    # CELERY_EXT_RETRY_BACKOFF_JITTER: ...and shortened by up to this fraction at random.
    "retry_backoff_jitter": 0.25,
    # -- enqueueing -----------------------------------------------------------------------
    # CELERY_EXT_UNIQUE_TTL: seconds a unique job's lock outlives its due time unreleased.
    "unique_ttl": 3600.0,
    # CELERY_EXT_MAX_PAYLOAD_BYTES: largest encoded job a producer may enqueue (0 = no limit).
    "max_payload_bytes": 1048576,
    # CELERY_EXT_PUBLISH_IDEMPOTENCY_TTL: seconds a publish is remembered, so that Kombu's
    # retry of a publish whose reply was lost writes nothing again (0 = off).
    "publish_idempotency_ttl": 120.0,
    # CELERY_EXT_WAIT_REPLICAS: replicas that must have a job before its enqueue returns
    # (Redis WAIT; 0 = do not wait: a failover may lose the last jobs).
    "wait_replicas": 0,
    # CELERY_EXT_WAIT_TIMEOUT_MS: longest WAIT for them; fewer in time raise NotReplicated.
    "wait_timeout_ms": 1000,
    # -- connections ----------------------------------------------------------------------
    # CELERY_EXT_REPLY_TIMEOUT: longest wait (s) for a reply before a connection counts as lost.
    "reply_timeout": 60.0,
    # CELERY_EXT_REPLY_PROBE_AFTER: a reply overdue this long makes the process probe the
    # server on a fresh connection (a half-open connection is dropped at once).
    "reply_probe_after": 3.0,
    # CELERY_EXT_PROBE_TIMEOUT: longest wait (s) for the probe's answer.
    "probe_timeout": 2.0,
    # -- periodic jobs (beat_schedule, run by the worker pools) -----------------------------
    # CELERY_EXT_PERIODIC: whether worker pools run the app's beat_schedule.
    "periodic": True,
    # CELERY_EXT_PERIODIC_GRACE: a due time later than this many seconds is missed...
    "periodic_grace": 30.0,
    # CELERY_EXT_PERIODIC_MISSED: ...and then run "once" for all, "skip"ped, or "all" run.
    "periodic_missed": "once",
    # -- records for the dashboard and the client -------------------------------------------
    # CELERY_EXT_HISTORY_SAMPLE_INTERVAL: seconds between two queue-size samples of history.
    "history_sample_interval": 60.0,
    # CELERY_EXT_JOB_INDEX: keep the job index (task id -> where the job is now).
    "job_index": True,
    # CELERY_EXT_JOB_INDEX_TTL: seconds a finished job's index entry is kept.
    "job_index_ttl": 3600.0,
    # CELERY_EXT_STOP_REQUEST_TTL: seconds a request to stop a running job holds.
    "stop_request_ttl": 86400.0,
    # CELERY_EXT_REVOKED_TTL: seconds a revoked task id is kept (Celery's REVOKE_EXPIRES).
    "revoked_ttl": 10800.0,
    # CELERY_EXT_REVOKED_MAX: most revoked ids kept (Celery's REVOKES_MAX).
    "revoked_max": 50000,
    # -- resumable jobs -------------------------------------------------------------------
    # CELERY_EXT_CURSOR_MAX_BYTES: bytes a resumable job's cursor may take as JSON.
    "cursor_max_bytes": 4096,
    # CELERY_EXT_CURSOR_TTL: seconds a cursor is kept after its last write (30 days).
    "cursor_ttl": 2592000.0,
    # CELERY_EXT_CURSOR_INTERVAL: a job writes its cursor at most this often (0 = always).
    "cursor_interval": 1.0,
}
# The result backend takes the broker's connection options (docs/results.md).
result_backend_transport_options = {
    key: broker_transport_options[key]
    for key in ("namespace", "global_keyprefix", "cluster", "reply_timeout", "wait_replicas",
                "wait_timeout_ms")
}

# Retry connecting at start (a worker that starts before its server waits for it).
broker_connection_retry_on_startup = True
# install(app) defaults these two to True: a job is acked when it finishes, and a job whose
# prefork child died is returned to its queue (max_recoveries bounds how often).
task_acks_late = True
task_reject_on_worker_lost = True
# Results expire: a day, as Celery's default (0 or None would keep them for ever).
result_expires = 24 * 3600
# Celery events for Flower and the dashboard's live view (`celery worker -E` does the same).
worker_send_task_events = True
task_send_sent_event = True
