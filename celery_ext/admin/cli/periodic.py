"""Periodic jobs (the app's beat_schedule, run by the worker pools): list, pause, resume,
run one now."""

from __future__ import annotations

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
    """Every entry with its schedule, next and last run, and last outcome."""
    items = client().periodic()
    return Output(items, [Table(
        ["ENTRY", "TASK", "SCHEDULE", "NEXT", "LAST RUN", "OUTCOME", "RUNS", "MISSED", "STATE"],
        [[e["name"], e["task"], e["schedule"], when(e["next_due"]), when(e["last_run_at"]),
          e["last_outcome"], e["runs"], e["missed"], "paused" if e["paused"] else "active"]
         for e in items],
        "no periodic jobs (none in beat_schedule, or no worker pool has run yet)")])


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
        raise NotFound(f"no periodic job entry {name} in the app's beat_schedule")
    return f"enqueued {name}: job {job_id}"


@click.group("periodic")
def periodic() -> None:
    """Periodic jobs (the app's beat_schedule, run by the worker pools): ls, pause, resume,
    run-now."""


for _command in (periodic_ls, periodic_pause, periodic_resume, periodic_run_now):
    periodic.add_command(_command)

COMMANDS = [periodic]
