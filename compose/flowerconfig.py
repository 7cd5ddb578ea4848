"""Flower's config for the compose stack (the image has it as /app/flowerconfig.py).

The one line celery-ext asks of a Flower config (docs/dashboard.md): Flower's broker
page, ``/api/queues/length`` and checkin progress for ``celery-ext://`` brokers.
"""

from celery_ext.admin.flower import enable

enable()
