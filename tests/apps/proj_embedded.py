"""Two apps for Celery's embedded test worker: one drop-in (only the URL is ours), one
with ``install(app)``; the same tasks on each."""

from __future__ import annotations

from typing import Any

from celery import Celery

import celery_ext

#: The plugin's fixtures point each app at the test's server and namespace.
dropin_app = Celery("proj_embedded_dropin", broker="celery-ext://127.0.0.1:1/0")
installed_app = celery_ext.install(Celery("proj_embedded_installed",
                                          broker="celery-ext://127.0.0.1:1/0"))
APPS = {"dropin": dropin_app, "install": installed_app}


def _tasks(app: Celery) -> dict[str, Any]:
    @app.task(name=f"{app.main}.add")
    def add(a: int, b: int) -> int:
        return a + b

    @app.task(name=f"{app.main}.boom")
    def boom() -> None:
        raise KeyError("boom")

    @app.task(name=f"{app.main}.progress", bind=True)
    def progress(self: Any, steps: int) -> int:
        for i in range(steps):
            self.checkin(message=f"step {i + 1}", progress=(i + 1) / steps)
        return steps

    return {"add": add, "boom": boom, "progress": progress}


TASKS = {mode: _tasks(app) for mode, app in APPS.items()}
