"""Test app with 1,000 job names, so 1,000 job queues (``celery -A tests.apps.proj_many``).

Each job adds its own name to the set ``many`` in db 2 of the broker's server.
"""

from __future__ import annotations

from typing import Any

from tests.apps.proj import app, recorder

#: How many job names (and job queues) this app registers.
N_JOBS = 1000


def job_name(i: int) -> str:
    return f"tests.apps.proj_many.job_{i:04d}"


def _make(i: int) -> Any:
    name = job_name(i)

    def job() -> str:
        recorder().sadd("many", name)
        return name

    job.__name__ = job.__qualname__ = f"job_{i:04d}"
    return app.task(name=name, ignore_result=True)(job)


JOBS = [_make(i) for i in range(N_JOBS)]

__all__ = ["JOBS", "N_JOBS", "app", "job_name"]
