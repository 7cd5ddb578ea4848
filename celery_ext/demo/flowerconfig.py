"""Flower's config file for the demo (``celery flower --conf=<this file>``).

The one line celery-ext asks of a Flower config (docs/dashboard.md): Flower's broker
page, ``/api/queues/length`` and checkin progress for ``celery-ext://`` brokers.
"""

from celery_ext.admin.flower import enable

enable()
