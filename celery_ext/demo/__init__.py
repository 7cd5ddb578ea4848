"""The demo: ``python -m celery_ext.demo`` (:mod:`celery_ext.demo.runner`) runs the
example app (:mod:`celery_ext.demo.app`, with its config :mod:`celery_ext.demo.celeryconfig`)
on an embedded server with two worker pools, the dashboard and Flower. It ships in the
wheel, so it runs from any folder."""
