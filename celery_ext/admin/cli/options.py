"""Options several commands share: paging, and the search filters of the sets."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import click

from celery_ext.admin.search import Filters

F = TypeVar("F", bound=Callable[..., Any])

_PAGE = [
    click.option("--limit", type=click.IntRange(1, 100_000), default=100, show_default=True,
                 help="Most entries to show."),
    click.option("--offset", type=click.IntRange(0), default=0, help="Entries to skip."),
]
_SEARCH = [
    click.option("--error", default=None, help="Only jobs whose error type is this, or whose "
                                                "error text contains it."),
    click.option("--text", default=None, help="Only jobs whose arguments contain this text."),
    click.option("--since", default=None, help="Only jobs failed at/after this time "
                                                "(seconds or ISO 8601)."),
    click.option("--until", default=None, help="Only jobs failed at/before this time."),
]


def paged(f: F) -> F:
    """``--limit`` and ``--offset``."""
    for option in reversed(_PAGE):
        f = option(f)
    return f


def searched(f: F) -> F:
    """``--error``, ``--text``, ``--since`` and ``--until``."""
    for option in reversed(_SEARCH):
        f = option(f)
    return f


def time_arg(value: str | None) -> float | None:
    """Seconds since the epoch, or an ISO 8601 time (without a zone: local time)."""
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither seconds nor an ISO 8601 time") from None


def filters(name: str | None, error: str | None, text: str | None, since: str | None,
            until: str | None) -> Filters:
    """The search filters of the options (a bad one: a usage error naming it)."""
    try:
        return Filters(name=name or "", error=error or "", text=text or "",
                       since=time_arg(since), until=time_arg(until))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
