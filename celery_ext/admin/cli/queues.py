"""Job queues: the status at a glance, the queue table, pause/resume and rate limits."""

from __future__ import annotations

from typing import Any

import click

from celery_ext.admin.cli.command import ClientGetter, Output, Table, command
from celery_ext.admin.cli.options import paged
from celery_ext.admin.cli.pools import busy_table, pool_table
from celery_ext.admin.cli.render import age
from celery_ext.text import one_line

QUEUE_HEADERS = ["QUEUE", "QUEUED", "LATENCY", "WEIGHT", "IN FLIGHT", "MAX", "RATE",
                 "PROCESSED", "FAILED", "STATE", "FAIR KEYS"]


def fair_cell(fair: Any) -> str:
    """A fair queue's active keys and its biggest ones, its per-key rate limit and the
    keys not due yet: "2 keys: big=5 small=1; 5/s per key; not due: big 0.2s"."""
    if not fair:
        return "-"
    n = fair["active_keys"]
    top = " ".join(f"{one_line(str(key), 40)}={size}" for key, size in fair["top_keys"])
    cell = f"{n} key{'s' if n != 1 else ''}: {top}"
    if fair.get("rate_limit"):
        cell += f"; {fair['rate_limit']} per key"
    if fair.get("not_due"):
        cell += "; not due: " + " ".join(f"{one_line(str(key), 40)} {wait:.1f}s"
                                         for key, wait in fair["not_due"])
    return cell


#: Seconds a queue's next job is due in from which its state says so (shorter waits are
#: a rate limit's ordinary spacing).
NOT_DUE_SHOWN = 1.0


def queue_table(items: list[Any]) -> Table:
    return Table(QUEUE_HEADERS, [
        [q["name"], q["size"], age(q["latency"]), q["weight"], q["in_flight"],
         q["max_concurrency"], q.get("rate_limit"), q["processed"], q["failed"],
         state_cell(q), fair_cell(q.get("fair"))] for q in items],
        "no job queues")


def state_cell(q: Any) -> str:
    """"paused" or "active", "no consumer" when no live worker pool consumes it, and
    when its next job is due if that is a second or more away."""
    state = "paused" if q["paused"] else "active"
    if not q.get("consumed", True):
        state += ", no consumer"
    wait = q.get("not_due_for")
    if wait is not None and wait >= NOT_DUE_SHOWN:
        state += f", next in {wait:.0f}s"  # held by Throttled, or a slow rate limit
    return state


def unconsumed_warning(queues: list[Any]) -> str | None:
    """One line naming the job queues whose jobs wait for a pool that consumes them."""
    waiting = [q for q in queues if q["size"] and not q.get("consumed", True)]
    if not waiting:
        return None
    return (f"{sum(q['size'] for q in waiting)} job(s) wait in job queue(s) no live worker "
            f"pool consumes (unknown task name, or a deploy not rolled out yet): "
            + ", ".join(q["name"] for q in waiting))


@command("status")
def status(client: ClientGetter) -> Output:
    """Queues, pools and busy workers at a glance."""
    c = client()
    queues, pools, busy = c.job_queues(), c.worker_pools(), c.busy_workers()
    sizes, totals = c.counts(), c.totals()
    summary = {
        "queued": sum(q["size"] for q in queues),
        "in_flight": sum(q["in_flight"] for q in queues),
        "queues": len(queues),
        "pools": len(pools),
        "busy": len(busy),
        **sizes,
        **totals,
    }
    warnings = [w for w in (c.memory_warning(), unconsumed_warning(queues)) if w]
    return Output(
        {"summary": summary, "queues": queues, "pools": pools, "busy": busy,
         "warnings": warnings},
        [*(f"warning: {w}" for w in warnings),
         f"queued {summary['queued']}  in flight {summary['in_flight']}  "
         f"busy {summary['busy']}  scheduled {sizes['scheduled']}  retry {sizes['retry']}  "
         f"dead {sizes['dead']}  processed {totals['processed']}  failed {totals['failed']}",
         "", queue_table(queues), "", pool_table(pools), "", busy_table(busy)])


@command("queues")
@click.option("--prefix", default=None, help="Only job queues whose name starts with this.")
@paged
def queues(client: ClientGetter, prefix: str | None, limit: int, offset: int) -> Output:
    """Job queues: size, latency, weight, in flight, counters, paused."""
    items = client().job_queues(offset, limit, prefix)
    return Output(items, [queue_table(items)])


@command("pause", json_option=False)
@click.argument("queue")
def pause(client: ClientGetter, queue: str) -> str:
    """Pause a job queue: workers stop fetching from it; its jobs stay."""
    return f"paused {queue}" if client().pause(queue) else f"{queue} was already paused"


@command("resume", json_option=False)
@click.argument("queue")
def resume(client: ClientGetter, queue: str) -> str:
    """Resume a paused job queue."""
    return f"resumed {queue}" if client().resume(queue) else f"{queue} was not paused"


@command("rate-limit")
@click.argument("queue", required=False)
@click.argument("rate", required=False)
@click.option("--clear", is_flag=True, help="Remove the queue's rate limit.")
def rate_limit(client: ClientGetter, queue: str | None, rate: str | None,
               clear: bool) -> Output:
    """Show or set job queues' rate limits (all pools together), e.g. 20/s, 10/m, 5/h.

    Without arguments, list them; with QUEUE only, show that one. A limit set here
    lasts until a worker pool consuming the queue starts and writes its tasks' own.
    """
    c = client()
    if queue is not None and (rate is not None or clear):
        if rate is not None and clear:
            raise click.UsageError("give a RATE or --clear, not both")
        try:
            stored = c.set_rate_limit(queue, None if clear else rate)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="RATE") from None
        return Output({"queue": queue, "rate_limit": stored},
                      [f"{queue}: rate limit {stored}" if stored else f"{queue}: no rate limit"])
    if clear:
        raise click.UsageError("--clear needs a QUEUE")
    limits = c.rate_limits()
    if queue is not None:
        limits = {queue: limits[queue]} if queue in limits else {}
    return Output(limits, [Table(["QUEUE", "RATE"], sorted(limits.items()), "no rate limits")])


COMMANDS = [status, queues, pause, resume, rate_limit]
