"""Test app for strategies built on a task's first message (``strategy.LazyStrategies``).

Workers run it as ``-A tests.apps.proj_lazy`` (``tests.apps.proj``'s app plus these
tasks): twenty job names whose strategy records its own building in Redis
(``strategies``, db 2), so a test counts how many a worker built and for which task.
"""

from __future__ import annotations

from typing import Any

from celery_ext.worker.strategy import default
from tests.apps.proj import app, recorder

#: The Redis list (db 2) every build of a counted task's strategy appends its name to.
BUILT_KEY = "strategies"


def counting(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    """``install(app)``'s strategy, recording each build."""
    recorder().rpush(BUILT_KEY, task.name)
    return default(task, app, consumer, **kwargs)


def _run(key: str) -> None:
    recorder().rpush(f"ran:{key}", 1)


#: Twenty tasks alike, each its own job name (and so its own job queue).
jobs = [app.task(name=f"tests.apps.proj_lazy.job_{i:02d}", ignore_result=True,
                 Strategy="tests.apps.proj_lazy:counting")(_run)
        for i in range(20)]


@app.task(ignore_result=True)
def frozen() -> None:
    """Records how many objects the worker froze out of the garbage collector's passes."""
    import gc

    recorder().set("frozen", gc.get_freeze_count())
