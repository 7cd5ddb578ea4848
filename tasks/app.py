"""The example Celery app: two lines turn a Celery app into a celery_ext app."""

from __future__ import annotations

from celery import Celery

import celery_ext

app = Celery("tasks", include=["tasks.jobs"])
app.config_from_object("config.celeryconfig")
celery_ext.install(app)
