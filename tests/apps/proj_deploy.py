"""An app configured from ``config/celeryconfig.py``, the production configuration a user
copies beside their app, loaded as they would load it (``config_from_object``); the broker
and result URLs come from the environment, as that file reads them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from celery import Celery

import celery_ext

_spec = importlib.util.spec_from_file_location(
    "celeryconfig", Path(__file__).resolve().parents[2] / "config" / "celeryconfig.py")
assert _spec is not None and _spec.loader is not None
celeryconfig = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(celeryconfig)

app = Celery("proj_deploy")
app.config_from_object(celeryconfig)
celery_ext.install(app)


@app.task
def add(a: int, b: int) -> Any:
    return a + b
