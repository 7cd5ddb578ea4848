"""The one decorator every ``celery ext`` command is made with, and how its output is shown.

A command function takes a getter of the :class:`~celery_ext.admin.client.Client` as
its first argument (the client is made on first use, so arguments are checked before
the app's broker is) and returns what to show: an :class:`Output` (data for
``--json``, lines and tables for a person), a line of text, or None. The decorator
adds ``--json`` where asked, renders the result, and turns Redis errors and unknown
ids into one-line ``Error: ...`` messages with exit status 1.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import click
import redis
from celery.bin.base import CeleryCommand
from kombu.exceptions import OperationalError

from celery_ext.admin.cli.render import cell
from celery_ext.admin.client import Client

#: What a command gets instead of the client: call it for the (one per run) client.
ClientGetter = Callable[[], Client]


class NotFound(Exception):
    """A job, entry or id the user named is not where the command looked (exit 1)."""


@dataclass(frozen=True)
class Table:
    """Rows under a header line, columns as wide as their widest cell; ``empty`` is
    shown instead when there are no rows."""

    headers: Sequence[str]
    rows: Sequence[Sequence[Any]]
    empty: str = "(none)"

    def lines(self) -> list[str]:
        if not self.rows:
            return [self.empty]
        cells = [[cell(v) for v in row] for row in self.rows]
        widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(self.headers)]
        return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                for row in [list(self.headers), *cells]]


@dataclass
class Output:
    """What a command shows: ``data`` with ``--json``, else ``text`` (lines and tables,
    in order); ``error``, when set, then ends the command with exit status 1."""

    data: Any
    text: list[str | Table] = field(default_factory=list)
    error: str | None = None


def client_of(ctx: click.Context) -> Client:
    """The client for the app Celery's ``-A`` loaded (made once per command run)."""
    root = ctx.find_root()
    cached = root.meta.get("celery_ext.client")
    if cached is None:
        app = getattr(ctx.obj, "app", None)
        if app is None:
            raise click.ClickException("no Celery app: run as `celery -A proj ext ...`")
        try:
            cached = Client.for_app(app)
        except ValueError as exc:
            raise click.ClickException(
                f"{exc}: set broker_url to celery-ext://... and import celery_ext") from None
        root.meta["celery_ext.client"] = cached
    return cached


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str, sort_keys=False))


def _show(result: Output | str | None, as_json: bool) -> None:
    if isinstance(result, str):
        click.echo(result)
        return
    if result is None:
        return
    if as_json:
        _emit_json(result.data)
    else:
        for part in result.text:
            for line in part.lines() if isinstance(part, Table) else [part]:
                click.echo(line)
    if result.error:
        raise NotFound(result.error)


def command(name: str, *, json_option: bool = True
            ) -> Callable[[Callable[..., Output | str | None]], click.Command]:
    """Make ``f(client, **options)`` a Celery command named ``name`` (the options are
    the ``click.option``/``click.argument`` decorators under this one)."""

    def decorate(f: Callable[..., Output | str | None]) -> click.Command:
        @functools.wraps(f)
        def callback(**kwargs: Any) -> None:
            ctx = click.get_current_context()
            as_json = bool(kwargs.pop("as_json", False))
            try:
                _show(f(lambda: client_of(ctx), **kwargs), as_json)
            except (redis.ConnectionError, OperationalError) as exc:
                raise click.ClickException(f"cannot reach Redis: {first_line(exc)}") from None
            except redis.RedisError as exc:
                raise click.ClickException(f"Redis error: {first_line(exc)}") from None
            except NotFound as exc:
                raise click.ClickException(str(exc)) from None

        # click reads the decorators' parameters in reverse: --json is listed last.
        params = list(getattr(f, "__click_params__", []))
        if json_option:
            params.insert(0, click.Option(["--json", "as_json"], is_flag=True,
                                          help="Print JSON instead of a table."))
        setattr(callback, "__click_params__", params)  # noqa: B010 (click's own attribute)
        return click.command(name, cls=CeleryCommand)(callback)

    return decorate

