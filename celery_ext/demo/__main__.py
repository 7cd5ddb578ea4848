"""``python -m celery_ext.demo``: see :mod:`celery_ext.demo.runner`."""

from celery_ext.demo.runner import run

raise SystemExit(run())
