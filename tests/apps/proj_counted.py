"""Test app whose strategies record their own building (``celery_ext.worker.strategy``).

Workers run it as ``-A tests.apps.proj_counted`` (``tests.apps.proj``'s app plus these
tasks): twenty job names whose strategy appends "<task name> <1 if the garbage collector
was on>" to a Redis list (db 2) each time it is built, so a test counts the builds and
sees how they ran; the collector's passes from the build to its first full pass are noted.
"""

from __future__ import annotations

import gc
from typing import Any

from celery_ext.worker.strategy import default
from tests.apps.proj import app, recorder

#: The Redis list (db 2) every build of a counted task's strategy appends to.
BUILT_KEY = "strategies"


#: The generation of each collector pass from the first build on, up to the first full
#: pass (``passes_after_build``); kept in memory: a collector callback makes no round trip.
_passes: list[int] = []
_watching = False


def _on_collect(phase: str, info: dict[str, Any]) -> None:
    global _watching
    if _watching and phase == "start":
        _passes.append(info["generation"])
        _watching = info["generation"] != 2


gc.callbacks.append(_on_collect)


def counting(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    """``install(app)``'s strategy, recording each build."""
    global _watching
    if not _passes and not _watching:
        _watching = True
    recorder().rpush(BUILT_KEY, f"{task.name} {int(gc.isenabled())}")
    return default(task, app, consumer, **kwargs)


def _run(key: str) -> None:
    recorder().rpush(f"ran:{key}", 1)


#: Twenty tasks alike, each its own job name (and so its own job queue).
jobs = [app.task(name=f"tests.apps.proj_counted.job_{i:02d}", ignore_result=True,
                 Strategy="tests.apps.proj_counted:counting")(_run)
        for i in range(20)]


@app.task(ignore_result=True)
def collector() -> None:
    """Records whether the garbage collector runs in the worker, and the generations of its
    passes from the strategies' build to its first full pass, comma-separated."""
    recorder().set("collector", int(gc.isenabled()))
    recorder().set("passes_after_build", ",".join(map(str, _passes)))
