"""Celery worker bootsteps added by ``install(app)``."""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps
from kombu import Queue

from .weights import set_weights

logger = logging.getLogger("celery_ext.bootsteps")


def job_queues(app: Any) -> dict[str, int]:
    """Job queue name -> weight for every registered task (explicit ``queue=`` kept)."""
    app.finalize(auto=True)
    result: dict[str, int] = {}
    for name, task in sorted(app.tasks.items()):
        queue = getattr(task, "queue", None) or name
        weight = getattr(task, "weight", None)
        if weight is not None:
            if not isinstance(weight, int) or isinstance(weight, bool) or weight < 1:
                raise ValueError(
                    f"celery_ext: task {name!r} has weight={weight!r}; "
                    "weight must be a whole number >= 1")
        result[queue] = max(result.get(queue, 1), weight or 1)
    return result


class JobQueues(bootsteps.Step):
    """Make a worker consume the job queue of every registered task.

    A worker started with ``-Q`` consumes only the queues it was given (their
    weights still apply); ``-X`` exclusions are honoured.
    """

    name = "celery_ext.JobQueues"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        app = worker.app
        weights = job_queues(app)
        set_weights(weights)
        queues = app.amqp.queues
        if getattr(queues, "_consume_from", None) is not None:
            return  # -Q given: the user chose the queues
        excluded = set(getattr(worker, "exclude_queues", None) or ())
        for name in weights:
            if name not in queues and name not in excluded:
                queues.select_add(Queue(name, routing_key=name))
        if not str(app.conf.broker_url or "").startswith(("celery-ext", "celery-exts")) \
                and "celery_ext" not in str(app.conf.broker_transport or ""):
            logger.warning(
                "celery_ext: install(app) is active but the broker is not celery-ext:// "
                "(jobs are routed per task name, without crash-safe ownership)")
