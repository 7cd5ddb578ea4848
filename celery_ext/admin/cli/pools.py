"""Worker pools and the jobs they run: pools, busy workers, one job's status, asking a
job to stop, cancelling a job by id (and the revoked ids), and a reaper pass."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from celery_ext.admin.cli.command import ClientGetter, Output, Table, command
from celery_ext.admin.cli.render import age, cell, when
from celery_ext.text import one_line


def pool_table(items: list[Any]) -> Table:
    return Table(["POOL", "NODE", "PID", "TYPE", "STATE", "HEARTBEAT", "IN FLIGHT", "QUEUES"],
                 [[p["pool_id"], p["node"], p["pid"], f"{p['pool_type']} x{p['concurrency']}",
                   p["state"], age(p["heartbeat_age"]), p["in_flight"], len(p["queues"])]
                  for p in items], "no worker pools")


def busy_table(items: list[Any]) -> Table:
    now = time.time()
    return Table(
        ["JOB ID", "JOB", "ARGS", "RUNNING", "PROGRESS", "CHECKIN", "STATE"],
        [[b["job_id"], b["job_name"], b["args"], age(now - b["started_at"]),
          f"{b['progress'] * 100:.0f}%" if b["progress"] is not None else "-",
          b["checkin_message"],
          "stop requested" if b["stop_requested"] else "stalled" if b["stalled"] else "running"]
         for b in items], "no busy workers")


@command("pools")
def pools(client: ClientGetter) -> Output:
    """Worker pools: host, pid, concurrency, heartbeat age, state."""
    items = client().worker_pools()
    return Output(items, [pool_table(items)])


@command("chords")
@click.option("--limit", default=100, show_default=True, type=int, help="Most chords to list.")
def chords(client: ClientGetter, limit: int) -> Output:
    """Chords whose body was not sent yet: header results counted of the header's size."""
    c = client()
    items = c.pending_chords(limit)
    now = c.server_time()  # applied_at is on the Redis clock
    return Output(items, [Table(
        ["CHORD (GROUP ID)", "COUNTED", "APPLIED"],
        [[c["group_id"], f"{c['counted']} of {c['size'] if c['size'] is not None else '?'}",
          age(now - c["applied_at"])] for c in items],
        "no pending chords (or the app's result backend is not celery-ext's)")])


@command("busy")
def busy(client: ClientGetter) -> Output:
    """Busy workers: the jobs running now, with checkin progress."""
    items = client().busy_workers()
    return Output(items, [busy_table(items)])


@command("stop", json_option=False)
@click.argument("job_id")
def stop(client: ClientGetter, job_id: str) -> Output:
    """Ask a running job to stop: its next checkin returns True."""
    if client().request_stop(job_id):
        return Output(None, [f"asked job {job_id} to stop"])
    return Output(None, error=f"job {job_id} is not in flight: only a fetched or running "
                              "job can be asked to stop")


@command("cancel")
@click.argument("job_id")
def cancel(client: ClientGetter, job_id: str) -> Output:
    """Cancel a job by id, wherever it is: queued, scheduled or retrying, it never runs
    (it goes to the dead set, reason revoked: at once, or a queued job deep in a long
    queue when its fetch pops it); running, its next checkin returns True;
    enqueued later with this id, it does not run either (for revoked_ttl)."""
    outcome = client().cancel(job_id)
    if outcome["removed"].get(job_id) == "queued":
        where = "removed from its job queue to the dead set"
    elif job_id in outcome["removed"]:
        where = f"removed from the {outcome['removed'][job_id]} set to the dead set"
    elif job_id in outcome["queued"]:
        where = "queued: the fetch that pops it moves it to the dead set"
    elif job_id in outcome["stop_requested"]:
        where = "in flight: asked to stop at its next checkin"
    elif job_id in outcome["inflight"]:
        where = "in flight"
    else:
        where = "not found now: a job enqueued with this id later will not run"
    return Output(outcome, [f"cancelled job {job_id}: {where}"])


@command("revoked")
def revoked(client: ClientGetter) -> Output:
    """Revoked and cancelled job ids that hold now: who, when, until when."""
    items = client().revoked()
    return Output(items, [Table(
        ["JOB ID", "BY", "VIA", "AT", "UNTIL"],
        [[r["task_id"], r["meta"].get("by"), r["meta"].get("via"),
          when((r["meta"].get("revoked_at") or 0) / 1000), when(r["lapses_at"])]
         for r in items], "no revoked jobs")])


@command("job")
@click.argument("job_id")
def job(client: ClientGetter, job_id: str) -> Output:
    """One job's status by id (queued, scheduled, running, succeeded, failed, dead...)."""
    c = client()
    st = c.job(job_id)
    if st["state"] == "queued" and not st["indexed"] and c.settings.job_index:
        # Every queued job has an index entry, written by the script that queued it;
        # "queued" without one is the lookup's last guess: nobody holds this id.
        return Output(None, error=f"unknown job id {job_id}: no queue, set, pool or "
                                  "result backend knows it")
    return Output(st, [f"{key:15} {_value(key, value)}" for key, value in st.items()
                       if value not in (None, False, "")
                       or (key == "cursor" and value is not None)])


def _value(key: str, value: object) -> str:
    """A status field as the other commands show it: times (``*_at``) in local time; the
    cursor as the JSON the job kept (a cursor ``"7"`` is not the cursor ``7``)."""
    if key.endswith("_at") and isinstance(value, int | float):
        return when(value)
    if key == "cursor":
        return one_line(json.dumps(value, default=str), 200)
    if key == "unique_lock" and isinstance(value, dict):
        holder = "held by this job" if value["held"] else \
            f"held by {value['holder']}" if value["holder"] else "free"
        left = f", {value['ttl']:.0f} s left" if value["ttl"] is not None else ""
        return f"{value['mode']}, {holder}{left} ({cell(value['key'], 120)})"
    return cell(value, 200)


@command("reap")
@click.option("--force", is_flag=True,
              help="Reap every pool whose heartbeat is old now, without first watching "
                   "Redis answer steadily. Right after a Redis outage or stall longer than "
                   "dead_after this declares LIVE pools dead: their running jobs run twice.")
def reap(client: ClientGetter, force: bool) -> Output:
    """Run one reaper pass now: requeue the jobs of dead worker pools.

    Each pool is judged by its own dead_after. Pools that look dead are first watched
    for two of their heartbeat intervals and a second (seconds with the defaults), so
    a Redis outage or stall is not taken for their death."""
    result = client().reap(force=force)
    text: list[str | Table] = []
    if result.watched:
        text.append(f"watched Redis answer steadily for {result.watched:.1f}s")
    if result.skipped:
        text.append(f"skipped: {result.skipped}")
    if result or not result.skipped:
        text.append(f"reaped {len(result.dead_pools)} dead pool(s): {len(result.requeued)} "
                    f"job(s) requeued, {len(result.dead_jobs)} to the dead set")
    return Output({"dead_pools": result.dead_pools, "requeued": result.requeued,
                   "dead_jobs": result.dead_jobs, "skipped": result.skipped,
                   "waiting": result.waiting, "watched": result.watched}, text)


COMMANDS = [pools, busy, chords, stop, cancel, revoked, job, reap]
