"""Periodic jobs (the app's beat_schedule and the entries set at runtime, run by the worker
pools): list, set, remove, pause, resume, run one now."""

from __future__ import annotations

import json
from typing import Any

import click

from celery_ext.admin.cli.command import (
    ClientGetter,
    NotFound,
    Output,
    Table,
    command,
    first_line,
)
from celery_ext.admin.cli.render import when


@command("ls")
def periodic_ls(client: ClientGetter) -> Output:
    """Every entry with its source, schedule, next and last run, and last outcome."""
    items = client().periodic()
    return Output(items, [Table(
        ["ENTRY", "SOURCE", "TASK", "SCHEDULE", "NEXT", "LAST RUN", "OUTCOME", "RUNS", "MISSED",
         "STATE"],
        [[e["name"], e["source"], e["task"], e["schedule"], when(e["next_due"]),
          when(e["last_run_at"]), e["last_outcome"], e["runs"], e["missed"],
          "paused" if e["paused"] else "active"]
         for e in items],
        "no periodic jobs (none in beat_schedule or set at runtime, or no worker pool has "
        "run yet)")])


def _json_option(value: str | None, option: str) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError as exc:
        raise click.UsageError(f"{option} is not JSON: {exc}") from None


@command("set", json_option=False)
@click.argument("name")
@click.argument("task")
@click.option("--every", type=float, help="Run every this many seconds (at least 1).")
@click.option("--crontab", "cron", metavar="'m h dom mon dow'",
              help="Run on this five-field crontab (the app's time zone).")
@click.option("--args", "args_json", metavar="JSON", help="Positional arguments, a JSON list.")
@click.option("--kwargs", "kwargs_json", metavar="JSON",
              help="Keyword arguments, a JSON object.")
@click.option("--queue", help="Send the runs to this queue (Celery's queue option).")
def periodic_set(client: ClientGetter, name: str, task: str, every: float | None,
                 cron: str | None, args_json: str | None, kwargs_json: str | None,
                 queue: str | None) -> str:
    """Create or replace a runtime entry (stored in Redis, wins over the app's entry of the
    same name). Bad input: exit status 2, nothing stored."""
    from celery_ext.client import InvalidPeriodicEntry

    args = _json_option(args_json, "--args")
    kwargs = _json_option(kwargs_json, "--kwargs")
    try:
        created = client().set_periodic(name, task, every=every, crontab=cron,
                                        args=[] if args is None else args, kwargs=kwargs,
                                        options={"queue": queue} if queue else None)
    except InvalidPeriodicEntry as exc:
        raise click.UsageError(str(exc)) from None
    return f"{'created' if created else 'replaced'} {name}"


@command("remove", json_option=False)
@click.argument("name")
def periodic_remove(client: ClientGetter, name: str) -> str:
    """Remove a runtime entry (the app's beat_schedule entry of that name, if any, runs
    again)."""
    if not client().remove_periodic(name):
        raise NotFound(f"no runtime periodic job entry {name} (entries of the app's "
                       "beat_schedule are changed in the app)")
    return f"removed {name}"


def _pause_or_resume(client: ClientGetter, name: str, pause: bool) -> str:
    changed = (client().pause_periodic if pause else client().resume_periodic)(name)
    if changed is None:
        raise NotFound(f"no periodic job entry {name}")
    if changed:
        return f"{'paused' if pause else 'resumed'} {name}"
    return f"{name} was already paused" if pause else f"{name} was not paused"


@command("pause", json_option=False)
@click.argument("name")
def periodic_pause(client: ClientGetter, name: str) -> str:
    """Pause an entry: its due times pass without runs until it is resumed."""
    return _pause_or_resume(client, name, True)


@command("resume", json_option=False)
@click.argument("name")
def periodic_resume(client: ClientGetter, name: str) -> str:
    """Resume a paused entry from its next due time."""
    return _pause_or_resume(client, name, False)


@command("run-now", json_option=False)
@click.argument("name")
def periodic_run_now(client: ClientGetter, name: str) -> str:
    """Enqueue one run of an entry now, outside its schedule (also when paused)."""
    from celery_ext.producer.periodic_run import PeriodicError

    try:
        job_id = client().run_periodic_now(name)
    except PeriodicError as exc:
        raise click.ClickException(f"{name} not enqueued: {first_line(exc)}") from None
    if job_id is None:
        raise NotFound(f"no periodic job entry {name} (runtime or in the app's beat_schedule)")
    return f"enqueued {name}: job {job_id}"


@click.group("periodic")
def periodic() -> None:
    """Periodic jobs (the app's beat_schedule and runtime entries, run by the worker pools):
    ls, set, remove, pause, resume, run-now."""


for _command in (periodic_ls, periodic_set, periodic_remove, periodic_pause, periodic_resume,
                 periodic_run_now):
    periodic.add_command(_command)

COMMANDS = [periodic]
