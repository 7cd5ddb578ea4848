"""Test app with Kombu's ``global_keyprefix`` transport option (``-A
tests.apps.proj_keyprefix``): the prefix comes from ``TEST_KEYPREFIX``. ``make_app`` builds
the same app for another prefix in the test process. Runs are recorded in db 2 of the
broker's server, under "runs:<key>", as the prefix of the app that ran them."""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

from celery import Celery

import celery_ext
from tests.apps import record_client

BROKER_URL = os.environ.get("CELERY_EXT_BROKER_URL", "celery-ext://127.0.0.1:6379/0")


def record_url(broker_url: str) -> str:
    """The plain redis:// URL of db 2 on the broker's server (not ``tests.apps.proj``'s
    helper: importing that module would make and install its app here too)."""
    parts = urlsplit(broker_url)
    return urlunsplit(("redis", parts.netloc, "/2", parts.query, ""))


def make_app(broker_url: str, prefix: str) -> Celery:
    """A Celery app on ``broker_url`` whose broker keys carry ``prefix``."""
    app = Celery("proj_keyprefix", broker=broker_url)
    app.conf.update(broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
                    broker_transport_options={"global_keyprefix": prefix})
    celery_ext.install(app)
    recorder = record_client(record_url(broker_url))

    @app.task(name="keyprefix.record")
    def record(key: str) -> None:
        recorder.rpush(f"runs:{key}", prefix)

    return app


app = make_app(BROKER_URL, os.environ.get("TEST_KEYPREFIX", "app1:"))
