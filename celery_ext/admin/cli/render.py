"""How values read in a terminal: one line per cell, ages, local times, job arguments."""

from __future__ import annotations

import json
import time
from typing import Any

from celery_ext.text import one_line


def cell(value: Any, width: int = 60) -> str:
    """A value as one table cell: names, ids and errors come from messages, so each is
    one line, cut to ``width``."""
    if value is None:
        return "-"
    if isinstance(value, float):
        text = f"{value:.1f}"
    elif isinstance(value, list | dict):
        text = json.dumps(value, default=str)
    else:
        text = str(value)
    return one_line(text, width)


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def args_text(job: Any) -> str:
    """A job's arguments as JSON: the positional list, then the keyword dict if any."""
    args, kwargs = job.get("args"), job.get("kwargs")
    parts = [json.dumps(args, default=str)] if args not in (None, []) else []
    if kwargs:
        parts.append(json.dumps(kwargs, default=str))
    return " ".join(parts)

