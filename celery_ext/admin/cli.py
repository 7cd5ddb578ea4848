"""``celery -A proj ext <command>``: look at and steer job queues, pools and the sets.

Registered through Celery's ``celery.commands`` entry point. Every command talks to
Redis through :class:`celery_ext.client.Client`, prints a table (``--json`` for
scripts), and exits non-zero with a one-line error on failure.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click
import redis
from celery.bin.base import CeleryCommand, handle_preload_options
from kombu.exceptions import OperationalError

from celery_ext.admin.client import Client
from celery_ext.admin.search import Filters
from celery_ext.text import one_line

F = TypeVar("F", bound=Callable[..., Any])


class NotFound(Exception):
    """A job the user named is not where the command looked (exit 1, one line)."""


# -- plumbing ---------------------------------------------------------------------------------
def _client(ctx: click.Context) -> Client:
    """The facade for the app Celery's ``-A`` loaded (one per command run)."""
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


def _friendly(f: F) -> F:
    """Turn Redis errors and unknown ids into one-line ``Error: ...`` messages (exit 1)."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except (redis.ConnectionError, OperationalError) as exc:
            raise click.ClickException(f"cannot reach Redis: {_first_line(exc)}") from None
        except redis.RedisError as exc:
            raise click.ClickException(f"Redis error: {_first_line(exc)}") from None
        except NotFound as exc:
            raise click.ClickException(str(exc)) from None

    return wrapper  # type: ignore[return-value]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str, sort_keys=False))


def _cell(value: Any, width: int = 60) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        text = f"{value:.1f}"
    elif isinstance(value, list | dict):
        text = json.dumps(value, default=str)
    else:
        text = str(value)
    return one_line(text, width)  # names, ids, errors come from messages: one row each


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], empty: str = "(none)") -> None:
    if not rows:
        click.echo(empty)
        return
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
page_options = [
    click.option("--limit", type=click.IntRange(1, 100_000), default=100, show_default=True,
                 help="Most entries to show."),
    click.option("--offset", type=click.IntRange(0), default=0, help="Entries to skip."),
]


def _paged(f: F) -> F:
    for option in reversed(page_options):
        f = option(f)
    return f


def _time_arg(value: str | None) -> float | None:
    """Seconds since the epoch, or an ISO 8601 time (without a zone: local time)."""
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    from datetime import datetime

    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither seconds nor an ISO 8601 time") from None


search_options = [
    click.option("--error", default=None, help="Only jobs whose error type is this, or whose "
                                                "error text contains it."),
    click.option("--text", default=None, help="Only jobs whose arguments contain this text."),
    click.option("--since", default=None, help="Only jobs failed at/after this time "
                                                "(seconds or ISO 8601)."),
    click.option("--until", default=None, help="Only jobs failed at/before this time."),
]


def _searched(f: F) -> F:
    for option in reversed(search_options):
        f = option(f)
    return f


def _filters(name: str | None, error: str | None, text: str | None, since: str | None,
             until: str | None) -> Filters:
    try:
        return Filters(name=name or "", error=error or "", text=text or "",
                       since=_time_arg(since), until=_time_arg(until))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


# -- the group --------------------------------------------------------------------------------
@click.group(name="ext")
@click.pass_context
@handle_preload_options
def ext(ctx: click.Context) -> None:
    """celery-ext: job queues, worker pools, busy workers, scheduled/retry/dead sets."""


def _queue_rows(items: list[Any]) -> list[list[Any]]:
    return [[q["name"], q["size"], _age(q["latency"]), q["weight"], q["in_flight"],
             q["max_concurrency"], q.get("rate_limit"), q["processed"], q["failed"],
             "paused" if q["paused"] else "active", _fair_cell(q.get("fair"))] for q in items]


def _fair_cell(fair: Any) -> str:
    """A fair queue's active keys and its biggest ones: "2 keys: big=5 small=1"."""
    if not fair:
        return "-"
    n = fair["active_keys"]
    top = " ".join(f"{one_line(str(key), 40)}={size}" for key, size in fair["top_keys"])
    return f"{n} key{'s' if n != 1 else ''}: {top}"


QUEUE_HEADERS = ["QUEUE", "QUEUED", "LATENCY", "WEIGHT", "IN FLIGHT", "MAX", "RATE",
                 "PROCESSED", "FAILED", "STATE", "FAIR KEYS"]


@ext.command(cls=CeleryCommand)
@json_option
@click.pass_context
@_friendly
def status(ctx: click.Context, as_json: bool) -> None:
    """Queues, pools and busy workers at a glance."""
    client = _client(ctx)
    queues, pools, busy = client.job_queues(), client.worker_pools(), client.busy_workers()
    sizes, totals = client.counts(), client.totals()
    summary = {
        "queued": sum(q["size"] for q in queues),
        "in_flight": sum(q["in_flight"] for q in queues),
        "queues": len(queues),
        "pools": len(pools),
        "busy": len(busy),
        **sizes,
        **totals,
    }
    warning = client.memory_warning()
    if as_json:
        _emit_json({"summary": summary, "queues": queues, "pools": pools, "busy": busy,
                    "warnings": [warning] if warning else []})
        return
    if warning:
        click.echo(f"warning: {warning}")
    click.echo(f"queued {summary['queued']}  in flight {summary['in_flight']}  "
               f"busy {summary['busy']}  scheduled {sizes['scheduled']}  retry {sizes['retry']}  "
               f"dead {sizes['dead']}  processed {totals['processed']}  failed {totals['failed']}")
    click.echo()
    _table(QUEUE_HEADERS, _queue_rows(queues), "no job queues")
    click.echo()
    _pool_table(pools)
    click.echo()
    _busy_table(busy)


@ext.command(cls=CeleryCommand)
@click.option("--prefix", default=None, help="Only job queues whose name starts with this.")
@_paged
@json_option
@click.pass_context
@_friendly
def queues(ctx: click.Context, prefix: str | None, limit: int, offset: int,
           as_json: bool) -> None:
    """Job queues: size, latency, weight, in flight, counters, paused."""
    items = _client(ctx).job_queues(offset, limit, prefix)
    if as_json:
        _emit_json(items)
    else:
        _table(QUEUE_HEADERS, _queue_rows(items), "no job queues")


def _pool_table(items: list[Any]) -> None:
    _table(["POOL", "NODE", "PID", "TYPE", "STATE", "HEARTBEAT", "IN FLIGHT", "QUEUES"],
           [[p["pool_id"], p["node"], p["pid"], f"{p['pool_type']} x{p['concurrency']}",
             p["state"], _age(p["heartbeat_age"]), p["in_flight"], len(p["queues"])]
            for p in items], "no worker pools")


@ext.command(cls=CeleryCommand)
@json_option
@click.pass_context
@_friendly
def pools(ctx: click.Context, as_json: bool) -> None:
    """Worker pools: host, pid, concurrency, heartbeat age, state."""
    items = _client(ctx).worker_pools()
    if as_json:
        _emit_json(items)
    else:
        _pool_table(items)


def _busy_table(items: list[Any]) -> None:
    now = time.time()
    _table(["JOB ID", "JOB", "ARGS", "RUNNING", "PROGRESS", "CHECKIN", "STATE"],
           [[b["job_id"], b["job_name"], b["args"], _age(now - b["started_at"]),
             f"{b['progress'] * 100:.0f}%" if b["progress"] is not None else "-",
             b["checkin_message"],
             "stop requested" if b["stop_requested"] else "stalled" if b["stalled"] else "running"]
            for b in items], "no busy workers")


@ext.command(cls=CeleryCommand)
@json_option
@click.pass_context
@_friendly
def busy(ctx: click.Context, as_json: bool) -> None:
    """Busy workers: the jobs running now, with checkin progress."""
    items = _client(ctx).busy_workers()
    if as_json:
        _emit_json(items)
    else:
        _busy_table(items)


@ext.command(cls=CeleryCommand)
@click.argument("job_id")
@click.pass_context
@_friendly
def stop(ctx: click.Context, job_id: str) -> None:
    """Ask a running job to stop: its next checkin returns True."""
    _client(ctx).request_stop(job_id)
    click.echo(f"asked job {job_id} to stop")


@ext.command(cls=CeleryCommand)
@click.argument("job_id")
@json_option
@click.pass_context
@_friendly
def job(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """One job's status by id (queued, scheduled, running, succeeded, failed, dead...)."""
    st = _client(ctx).job(job_id)
    if as_json:
        _emit_json(st)
        return
    for key, value in st.items():
        if value not in (None, False, ""):
            click.echo(f"{key:15} {_cell(value, 200)}")


def _args_text(job: Any) -> str:
    args, kwargs = job.get("args"), job.get("kwargs")
    parts = [json.dumps(args, default=str)] if args not in (None, []) else []
    if kwargs:
        parts.append(json.dumps(kwargs, default=str))
    return " ".join(parts)


def _more(page: Any) -> None:
    shown = page["offset"] + len(page["items"])
    if shown < page["total"]:
        click.echo(f"({shown} of {page['total']}; --offset {shown} for more)")


def _set_rows(items: list[Any], retry: bool) -> list[list[Any]]:
    rows = []
    for j in items:
        row = [j["id"], j["name"], _when(j["due_at"]), j["task_id"], _args_text(j)]
        if retry:
            row += [j["attempt"], j["error"]]
        rows.append(row)
    return rows


@ext.command(cls=CeleryCommand)
@click.option("--name", default=None, help="Only jobs of this job name.")
@_paged
@json_option
@click.pass_context
@_friendly
def scheduled(ctx: click.Context, name: str | None, limit: int, offset: int,
    as_json: bool) -> None:
    """Scheduled jobs (countdown/eta), soonest first."""
    page = _client(ctx).scheduled(offset, limit, name)
    if as_json:
        _emit_json(page)
    else:
        _table(["ID", "JOB", "DUE", "JOB ID", "ARGS"], _set_rows(page["items"], False),
               "no scheduled jobs")
        _more(page)


@ext.command(cls=CeleryCommand)
@click.option("--name", default=None, help="Only jobs of this job name.")
@_paged
@json_option
@click.pass_context
@_friendly
def retry(ctx: click.Context, name: str | None, limit: int, offset: int,
    as_json: bool) -> None:
    """The retry set: failed jobs waiting for their next attempt, soonest first."""
    page = _client(ctx).retries(offset, limit, name)
    if as_json:
        _emit_json(page)
    else:
        _table(["ID", "JOB", "DUE", "JOB ID", "ARGS", "ATTEMPT", "LAST ERROR"],
               _set_rows(page["items"], True), "no jobs waiting to be retried")
        _more(page)


@ext.group()
def dead() -> None:
    """The dead set: list, show, retry, delete."""


@dead.command("ls", cls=CeleryCommand)
@click.option("--name", default=None, help="Only jobs of this job name.")
@_searched
@click.option("--cursor", default=None, help="With filters: go on from a previous page.")
@_paged
@json_option
@click.pass_context
@_friendly
def dead_ls(ctx: click.Context, name: str | None, error: str | None, text: str | None,
            since: str | None, until: str | None, cursor: str | None, limit: int, offset: int,
            as_json: bool) -> None:
    """Dead jobs, newest first (filtered on the server with --error/--text/--since/--until)."""
    filters = _filters(name, error, text, since, until)
    if cursor or error or text or since or until:
        try:
            found = _client(ctx).search("dead", filters, cursor, limit)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
        page: Any = {**found, "offset": 0, "limit": limit, "total": len(found["items"])}
    else:
        page = _client(ctx).dead(offset, limit, name)
    if as_json:
        _emit_json({**page, "items": [{k: v for k, v in j.items() if k != "payload"}
                                      for j in page["items"]]})
        return
    _table(["ID", "JOB", "FAILED AT", "REASON", "ERROR", "ARGS"],
           [[j["id"], j["name"], _when(j["failed_at"]), j["reason"], j["error"], _args_text(j)]
            for j in page["items"]], "the dead set is empty")
    if page.get("cursor"):
        click.echo(f"(more: --cursor {page['cursor']})")
    elif "cursor" not in page:
        _more(page)


@dead.command("show", cls=CeleryCommand)
@click.argument("dead_id")
@json_option
@click.pass_context
@_friendly
def dead_show(ctx: click.Context, dead_id: str, as_json: bool) -> None:
    """One dead job with its arguments and traceback."""
    job = _client(ctx).dead_job(dead_id)
    if job is None:
        raise NotFound(f"no dead job {dead_id}")
    if as_json:
        _emit_json(job)
        return
    for key in ("id", "task_id", "name", "queue", "fair_key", "reason", "error", "attempts",
                "manual_retries", "hostname", "pool"):
        if job.get(key) not in (None, ""):  # from a message: no raw control characters
            click.echo(f"{key:15} {one_line(str(job.get(key)), 2000)}")
    click.echo(f"{'failed at':15} {_when(job['failed_at'])}")
    click.echo(f"{'args':15} {json.dumps(job.get('args'), default=str)}")
    click.echo(f"{'kwargs':15} {json.dumps(job.get('kwargs'), default=str)}")
    if job.get("traceback"):
        click.echo("\n" + str(job["traceback"]).rstrip())


def _ids_or_all(ids: tuple[str, ...], all_: bool) -> list[str] | None:
    if all_ and ids:
        raise click.UsageError("give dead job ids or --all, not both")
    if not all_ and not ids:
        raise click.UsageError("give one or more dead job ids, or --all")
    return None if all_ else list(ids)


@dead.command("retry", cls=CeleryCommand)
@click.argument("ids", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Retry every dead job.")
@click.option("--name", default=None, help="With --all: only dead jobs of this job name.")
@_searched
@json_option
@click.pass_context
@_friendly
def dead_retry(ctx: click.Context, ids: tuple[str, ...], all_: bool, name: str | None,
               error: str | None, text: str | None, since: str | None, until: str | None,
               as_json: bool) -> None:
    """Put dead jobs back at the front of their job queues (--all: every one, or
    every one that matches the filters)."""
    wanted = _ids_or_all(ids, all_)
    client = _client(ctx)
    filters = _filters(name, error, text, since, until)
    missing: list[str] = []
    if wanted is None:
        count = (client.retry_matching("dead", filters) if error or text or since or until
                 else client.retry_all_dead(name))
    else:
        missing = [i for i in dict.fromkeys(wanted) if not client.retry_dead(i)]
        count = len(set(wanted)) - len(missing)
    if as_json:
        _emit_json({"retried": count, "missing": missing})
    else:
        click.echo(f"retried {count} dead job(s)")
    if missing:
        raise NotFound(f"not in the dead set: {', '.join(missing)}")


@dead.command("rm", cls=CeleryCommand)
@click.argument("ids", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Delete every dead job.")
@click.option("--name", default=None, help="With --all: only dead jobs of this job name.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask before deleting --all.")
@_searched
@json_option
@click.pass_context
@_friendly
def dead_rm(ctx: click.Context, ids: tuple[str, ...], all_: bool, name: str | None,
            yes: bool, error: str | None, text: str | None, since: str | None,
            until: str | None, as_json: bool) -> None:
    """Delete dead jobs for good (--all: every one, or every one that matches)."""
    wanted = _ids_or_all(ids, all_)
    client = _client(ctx)
    missing: list[str] = []
    filters = _filters(name, error, text, since, until)
    if wanted is None:
        if not yes and sys.stdin.isatty():
            click.confirm("Delete every matching dead job? There is no undo.", abort=True)
        count = (client.delete_matching("dead", filters) if error or text or since or until
                 else client.delete_all_dead(name))
    else:
        missing = [i for i in dict.fromkeys(wanted) if not client.delete_dead(i)]
        count = len(set(wanted)) - len(missing)
    if as_json:
        _emit_json({"deleted": count, "missing": missing})
    else:
        click.echo(f"deleted {count} dead job(s)")
    if missing:
        raise NotFound(f"not in the dead set: {', '.join(missing)}")


@ext.command(cls=CeleryCommand)
@click.argument("queue")
@click.pass_context
@_friendly
def pause(ctx: click.Context, queue: str) -> None:
    """Pause a job queue: workers stop fetching from it; its jobs stay."""
    changed = _client(ctx).pause(queue)
    click.echo(f"paused {queue}" if changed else f"{queue} was already paused")


@ext.command(cls=CeleryCommand)
@click.argument("queue")
@click.pass_context
@_friendly
def resume(ctx: click.Context, queue: str) -> None:
    """Resume a paused job queue."""
    changed = _client(ctx).resume(queue)
    click.echo(f"resumed {queue}" if changed else f"{queue} was not paused")


@ext.group()
def periodic() -> None:
    """Periodic jobs (the app's beat_schedule, run by the worker pools): ls, pause, resume,
    run-now."""


@periodic.command("ls", cls=CeleryCommand)
@json_option
@click.pass_context
@_friendly
def periodic_ls(ctx: click.Context, as_json: bool) -> None:
    """Every entry with its schedule, next and last run, and last outcome."""
    items = _client(ctx).periodic()
    if as_json:
        _emit_json(items)
        return
    _table(["ENTRY", "TASK", "SCHEDULE", "NEXT", "LAST RUN", "OUTCOME", "RUNS", "MISSED",
            "STATE"],
           [[e["name"], e["task"], e["schedule"], _when(e["next_due"]),
             _when(e["last_run_at"]), e["last_outcome"], e["runs"], e["missed"],
             "paused" if e["paused"] else "active"] for e in items],
           "no periodic jobs (none in beat_schedule, or no worker pool has run yet)")


def _periodic_action(ctx: click.Context, name: str, pause: bool) -> None:
    changed = (_client(ctx).pause_periodic if pause else _client(ctx).resume_periodic)(name)
    if changed is None:
        raise NotFound(f"no periodic job entry {name}")
    if changed:
        click.echo(f"{'paused' if pause else 'resumed'} {name}")
    else:
        click.echo(f"{name} was already paused" if pause else f"{name} was not paused")


@periodic.command("pause", cls=CeleryCommand)
@click.argument("name")
@click.pass_context
@_friendly
def periodic_pause(ctx: click.Context, name: str) -> None:
    """Pause an entry: its due times pass without runs until it is resumed."""
    _periodic_action(ctx, name, True)


@periodic.command("resume", cls=CeleryCommand)
@click.argument("name")
@click.pass_context
@_friendly
def periodic_resume(ctx: click.Context, name: str) -> None:
    """Resume a paused entry from its next due time."""
    _periodic_action(ctx, name, False)


@periodic.command("run-now", cls=CeleryCommand)
@click.argument("name")
@click.pass_context
@_friendly
def periodic_run_now(ctx: click.Context, name: str) -> None:
    """Enqueue one run of an entry now, outside its schedule (also when paused)."""
    from celery_ext.producer.periodic_run import PeriodicError

    try:
        job_id = _client(ctx).run_periodic_now(name)
    except PeriodicError as exc:
        raise click.ClickException(f"{name} not enqueued: {_first_line(exc)}") from None
    if job_id is None:
        raise NotFound(f"no periodic job entry {name} in the app's beat_schedule")
    click.echo(f"enqueued {name}: job {job_id}")
@ext.command(name="rate-limit", cls=CeleryCommand)
@click.argument("queue", required=False)
@click.argument("rate", required=False)
@click.option("--clear", is_flag=True, help="Remove the queue's rate limit.")
@json_option
@click.pass_context
@_friendly
def rate_limit(ctx: click.Context, queue: str | None, rate: str | None, clear: bool,
               as_json: bool) -> None:
    """Show or set job queues' rate limits (all pools together), e.g. 20/s, 10/m, 5/h.

    Without arguments, list them; with QUEUE only, show that one. A limit set here
    lasts until a worker pool consuming the queue starts and writes its tasks' own.
    """
    client = _client(ctx)
    if queue is not None and (rate is not None or clear):
        if rate is not None and clear:
            raise click.UsageError("give a RATE or --clear, not both")
        try:
            stored = client.set_rate_limit(queue, None if clear else rate)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="RATE") from None
        if as_json:
            _emit_json({"queue": queue, "rate_limit": stored})
        else:
            click.echo(f"{queue}: rate limit {stored}" if stored else f"{queue}: no rate limit")
        return
    if clear:
        raise click.UsageError("--clear needs a QUEUE")
    limits = client.rate_limits()
    if queue is not None:
        limits = {queue: limits[queue]} if queue in limits else {}
    if as_json:
        _emit_json(limits)
    else:
        _table(["QUEUE", "RATE"], sorted(limits.items()), "no rate limits")


@ext.command(cls=CeleryCommand)
@click.option("--force", is_flag=True,
              help="Reap every pool whose heartbeat is old now, without first watching "
                   "Redis answer steadily. Right after a Redis outage or stall longer than "
                   "dead_after this declares LIVE pools dead: their running jobs run twice.")
@json_option
@click.pass_context
@_friendly
def reap(ctx: click.Context, force: bool, as_json: bool) -> None:
    """Run one reaper pass now: requeue the jobs of dead worker pools.

    Each pool is judged by its own dead_after. Pools that look dead are first watched
    for two of their heartbeat intervals and a second (seconds with the defaults), so
    a Redis outage or stall is not taken for their death."""
    result = _client(ctx).reap(force=force)
    data = {"dead_pools": result.dead_pools, "requeued": result.requeued,
            "dead_jobs": result.dead_jobs, "skipped": result.skipped,
            "waiting": result.waiting, "watched": result.watched}
    if as_json:
        _emit_json(data)
        return
    if result.watched:
        click.echo(f"watched Redis answer steadily for {result.watched:.1f}s")
    if result.skipped:
        click.echo(f"skipped: {result.skipped}")
    if result or not result.skipped:
        click.echo(f"reaped {len(result.dead_pools)} dead pool(s): {len(result.requeued)} job(s) "
                   f"requeued, {len(result.dead_jobs)} to the dead set")


@ext.command(cls=CeleryCommand)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=5040, show_default=True, type=int, help="Port to listen on.")
@click.option("--token", envvar="CELERY_EXT_WEB_TOKEN", default=None,
              help="Require this bearer token (env CELERY_EXT_WEB_TOKEN). "
                   "Browsers: open /?token=... once.")
@click.option("--basic-auth", envvar="CELERY_EXT_WEB_BASIC_AUTH", default=None,
              metavar="USER:PASSWORD",
              help="Require HTTP basic auth (env CELERY_EXT_WEB_BASIC_AUTH).")
@click.option("--allow-origin", "allow_origins", multiple=True,
              help="Let pages on this origin read /api/jobs/... (the embeddable widget).")
@click.option("--root-path", default="", help="URL prefix when served behind a proxy.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.pass_context
@_friendly
def web(ctx: click.Context, host: str, port: int, token: str | None, basic_auth: str | None,
        allow_origins: tuple[str, ...], root_path: str, log_level: str) -> None:
    """Serve the dashboard and its JSON API (default http://127.0.0.1:5040/)."""
    try:
        from celery_ext.admin.web import serve
    except ImportError as exc:
        raise click.ClickException(
            f"the dashboard needs its extra: pip install 'celery-ext[web]' ({exc})") from None
    if basic_auth is not None and ":" not in basic_auth:
        raise click.BadParameter("expected USER:PASSWORD", param_hint="--basic-auth")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(message)s")
    client = _client(ctx)
    client.ping()
    serve(client, host=host, port=port, token=token, basic_auth=basic_auth,
          allow_origins=allow_origins, log_level=log_level, root_path=root_path)


@ext.command(cls=CeleryCommand)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=5041, show_default=True, type=int, help="Port to listen on.")
@click.pass_context
@_friendly
def metrics(ctx: click.Context, host: str, port: int) -> None:
    """Serve only the Prometheus metrics, at /metrics (no dashboard, no authentication:
    bind a private address; the dashboard's /metrics sits behind its token)."""
    try:
        from prometheus_client import start_http_server

        from celery_ext.admin.metrics import registry_for
    except ImportError as exc:
        raise click.ClickException(
            f"metrics need their extra: pip install 'celery-ext[metrics]' ({exc})") from None
    client = _client(ctx)
    client.ping()
    server, thread = start_http_server(port, addr=host, registry=registry_for(client))
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"celery_ext metrics on http://{shown}:{port}/metrics", err=True)
    try:
        while thread.is_alive():
            thread.join(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
