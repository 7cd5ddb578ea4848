"""The pytest plugin: ``pytest_plugins = ("celery_ext.pytest",)``, or loaded by its
``pytest11`` entry point ``celery_ext``. The fixtures live in
:mod:`celery_ext.testing.fixtures`; see docs/testing.md."""

from celery_ext.testing.fixtures import (
    celery_ext_app,
    celery_ext_broker_url,
    celery_ext_client,
    celery_ext_configured_app,
    celery_ext_namespace,
    celery_ext_server,
    celery_ext_worker,
    celery_ext_worker_options,
    pytest_addoption,
)

__all__ = [
    "celery_ext_app",
    "celery_ext_broker_url",
    "celery_ext_client",
    "celery_ext_configured_app",
    "celery_ext_namespace",
    "celery_ext_server",
    "celery_ext_worker",
    "celery_ext_worker_options",
    "pytest_addoption",
]
