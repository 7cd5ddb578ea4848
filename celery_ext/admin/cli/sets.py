"""The scheduled, retry and dead sets: list, search, show, retry, delete."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click

from celery_ext.admin.cli.command import ClientGetter, NotFound, Output, Table, command
from celery_ext.admin.cli.options import filters, paged, searched
from celery_ext.admin.cli.render import args_text, when
from celery_ext.text import one_line

_NAME = click.option("--name", default=None, help="Only jobs of this job name.")
#: A dead job's fields ``dead show`` prints, in this order, when set.
_DEAD_FIELDS = ("id", "task_id", "name", "queue", "fair_key", "reason", "error", "attempts",
                "manual_retries", "hostname", "pool")


def _more(page: Any) -> list[str | Table]:
    shown = page["offset"] + len(page["items"])
    if shown < page["total"]:
        return [f"({shown} of {page['total']}; --offset {shown} for more)"]
    return []


def _set_rows(items: list[Any], retry: bool) -> list[list[Any]]:
    rows = []
    for j in items:
        row = [j["id"], j["name"], when(j["due_at"]), j["task_id"], args_text(j)]
        if retry:
            row += [j["attempt"], j["error"]]
        rows.append(row)
    return rows


@command("scheduled")
@_NAME
@paged
def scheduled(client: ClientGetter, name: str | None, limit: int, offset: int) -> Output:
    """Scheduled jobs (countdown/eta), soonest first."""
    page = client().scheduled(offset, limit, name)
    return Output(page, [Table(["ID", "JOB", "DUE", "JOB ID", "ARGS"],
                               _set_rows(page["items"], False), "no scheduled jobs"),
                         *_more(page)])


@command("retry")
@_NAME
@paged
def retry(client: ClientGetter, name: str | None, limit: int, offset: int) -> Output:
    """The retry set: failed jobs waiting for their next attempt, soonest first."""
    page = client().retries(offset, limit, name)
    return Output(page, [Table(["ID", "JOB", "DUE", "JOB ID", "ARGS", "ATTEMPT", "LAST ERROR"],
                               _set_rows(page["items"], True), "no jobs waiting to be retried"),
                         *_more(page)])


@command("ls")
@_NAME
@searched
@click.option("--cursor", default=None, help="With filters: go on from a previous page.")
@paged
def dead_ls(client: ClientGetter, name: str | None, error: str | None, text: str | None,
            since: str | None, until: str | None, cursor: str | None, limit: int,
            offset: int) -> Output:
    """Dead jobs, newest first (filtered on the server with --error/--text/--since/--until)."""
    wanted = filters(name, error, text, since, until)
    if cursor or error or text or since or until:
        try:
            found = client().search("dead", wanted, cursor, limit)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
        page: Any = {**found, "offset": 0, "limit": limit, "total": len(found["items"])}
    else:
        page = client().dead(offset, limit, name)
    shown: list[str | Table] = [
        Table(["ID", "JOB", "FAILED AT", "REASON", "ERROR", "ARGS"],
              [[j["id"], j["name"], when(j["failed_at"]), j["reason"], j["error"], args_text(j)]
               for j in page["items"]], "the dead set is empty")]
    if page.get("cursor"):
        shown.append(f"(more: --cursor {page['cursor']})")
    elif "cursor" not in page:
        shown += _more(page)
    return Output({**page, "items": [{k: v for k, v in j.items() if k != "payload"}
                                     for j in page["items"]]}, shown)


@command("show")
@click.argument("dead_id")
def dead_show(client: ClientGetter, dead_id: str) -> Output:
    """One dead job with its arguments and traceback."""
    job = client().dead_job(dead_id)
    if job is None:
        raise NotFound(f"no dead job {dead_id}")
    text: list[str | Table] = [
        f"{key:15} {one_line(str(job.get(key)), 2000)}"  # from a message: no control chars
        for key in _DEAD_FIELDS if job.get(key) not in (None, "")]
    text += [f"{'failed at':15} {when(job['failed_at'])}",
             f"{'args':15} {json.dumps(job.get('args'), default=str)}",
             f"{'kwargs':15} {json.dumps(job.get('kwargs'), default=str)}"]
    if job.get("traceback"):
        text.append("\n" + str(job["traceback"]).rstrip())
    return Output(job, text)


def _ids_or_all(ids: tuple[str, ...], all_: bool) -> list[str] | None:
    if all_ and ids:
        raise click.UsageError("give dead job ids or --all, not both")
    if not all_ and not ids:
        raise click.UsageError("give one or more dead job ids, or --all")
    return None if all_ else list(ids)


def _each_or_all(wanted: list[str] | None, one: Callable[[str], bool],
                 every: Callable[[], int]) -> tuple[int, list[str]]:
    """(how many were acted on, the ids that were not dead): ``one`` for each id
    wanted, or ``every`` for all (None)."""
    if wanted is None:
        return every(), []
    missing = [i for i in dict.fromkeys(wanted) if not one(i)]
    return len(set(wanted)) - len(missing), missing


def _missing(missing: list[str]) -> str | None:
    return f"not in the dead set: {', '.join(missing)}" if missing else None


@command("retry")
@click.argument("ids", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Retry every dead job.")
@click.option("--name", default=None, help="With --all: only dead jobs of this job name.")
@searched
def dead_retry(client: ClientGetter, ids: tuple[str, ...], all_: bool, name: str | None,
               error: str | None, text: str | None, since: str | None,
               until: str | None) -> Output:
    """Put dead jobs back at the front of their job queues (--all: every one, or
    every one that matches the filters)."""
    wanted = _ids_or_all(ids, all_)
    c = client()
    matching = filters(name, error, text, since, until)
    count, missing = _each_or_all(wanted, c.retry_dead, lambda: (
        c.retry_matching("dead", matching) if error or text or since or until
        else c.retry_all_dead(name)))
    return Output({"retried": count, "missing": missing}, [f"retried {count} dead job(s)"],
                  _missing(missing))


@command("rm")
@click.argument("ids", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Delete every dead job.")
@click.option("--name", default=None, help="With --all: only dead jobs of this job name.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask before deleting --all.")
@searched
def dead_rm(client: ClientGetter, ids: tuple[str, ...], all_: bool, name: str | None,
            yes: bool, error: str | None, text: str | None, since: str | None,
            until: str | None) -> Output:
    """Delete dead jobs for good (--all: every one, or every one that matches)."""
    wanted = _ids_or_all(ids, all_)
    c = client()
    matching = filters(name, error, text, since, until)
    if wanted is None and not yes and sys.stdin.isatty():
        click.confirm("Delete every matching dead job? There is no undo.", abort=True)
    count, missing = _each_or_all(wanted, c.delete_dead, lambda: (
        c.delete_matching("dead", matching) if error or text or since or until
        else c.delete_all_dead(name)))
    return Output({"deleted": count, "missing": missing}, [f"deleted {count} dead job(s)"],
                  _missing(missing))


@click.group("dead")
def dead() -> None:
    """The dead set: list, show, retry, delete."""


for _command in (dead_ls, dead_show, dead_retry, dead_rm):
    dead.add_command(_command)

COMMANDS = [scheduled, retry, dead]
