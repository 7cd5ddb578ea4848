"""Retry backoff: the task option ``backoff``, exponential with jitter and a cap.

``backoff=True`` or ``backoff={"base": 5, "max": 600, "jitter": 0.5}`` replaces the task's
``default_retry_delay``, i.e. the countdown of a ``self.retry()`` (or ``autoretry_for``)
that names none. ``install(app)`` applies it when the worker starts.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery_ext.config import Settings


@dataclass(frozen=True)
class Backoff:
    """Retry delays ``base * 2**attempt`` capped at ``max``, minus up to ``jitter`` of it."""

    base: float
    max: float
    jitter: float

    def __post_init__(self) -> None:
        if self.base <= 0 or self.max < self.base or not 0 <= self.jitter <= 1:
            raise ValueError(f"celery_ext: invalid backoff {self!r}: need 0 < base <= max "
                             "and 0 <= jitter <= 1")

    def delay(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        """Seconds before retry number ``attempt + 1`` (``attempt`` = retries so far)."""
        full = min(self.max, self.base * 2 ** min(max(attempt, 0), 63))
        return full * (1 - self.jitter * rand())


def backoff_for(task: Any, settings: Settings) -> Backoff | None:
    """The backoff a task opted into with its ``backoff`` option, or None."""
    option = getattr(task, "backoff", None)
    if option is None or option is False:
        return None
    default = Backoff(settings.retry_backoff_base, settings.retry_backoff_max,
                      settings.retry_backoff_jitter)
    if option is True:
        return default
    if isinstance(option, Backoff):
        return option
    if isinstance(option, Mapping) and set(option) <= {"base", "max", "jitter"}:
        return Backoff(float(option.get("base", default.base)),
                       float(option.get("max", default.max)),
                       float(option.get("jitter", default.jitter)))
    raise ValueError(f"celery_ext: task {task.name!r} has backoff={option!r}; use True, "
                     "a celery_ext.options.backoff.Backoff, or a dict with base, max and jitter")


class _BackoffDelay:
    """``default_retry_delay`` of a task with a backoff: read by ``Task.retry``."""

    def __init__(self, backoff: Backoff) -> None:
        self.backoff = backoff

    def __get__(self, task: Any, owner: Any = None) -> float:
        if task is None:
            return self.backoff.base
        retries = getattr(task.request, "retries", 0) or 0
        return self.backoff.delay(int(retries))


def apply_backoffs(tasks: Mapping[str, Any], settings: Settings) -> list[str]:
    """Give every task with a ``backoff`` option its backoff; returns their names."""
    names = []
    for name, task in tasks.items():
        backoff = backoff_for(task, settings)
        if backoff is not None:
            type(task).default_retry_delay = _BackoffDelay(backoff)
            names.append(name)
    return names
