"""Weights of job queues known to this process (set by ``install(app)`` from task options)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_weights: dict[str, int] = {}


def set_weights(weights: Mapping[str, int]) -> None:
    """Record the weight of each job queue; later values win."""
    for name, weight in weights.items():
        weight = int(weight)
        if weight < 1:
            raise ValueError(f"celery_ext: weight of {name!r} must be a whole number >= 1")
        _weights[name] = weight


def weight_of(queue: str, default: int = 1) -> int:
    return _weights.get(queue, default)


def all_weights() -> dict[str, int]:
    return dict(_weights)


def task_weight(task: Any) -> int | None:
    """A task's ``weight`` option, or None; ValueError naming the task for anything but a
    whole number >= 1."""
    weight = getattr(task, "weight", None)
    if weight is not None and (not isinstance(weight, int) or isinstance(weight, bool)
                               or weight < 1):
        raise ValueError(f"celery_ext: task {task.name!r} has weight={weight!r}; "
                         "weight must be a whole number >= 1")
    return weight
