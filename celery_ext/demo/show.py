"""What the demo prints: timestamped event lines, and on a terminal a screen redrawn
each second with the job queues, pools, busy workers and periodic jobs, read from Redis
through :class:`celery_ext.client.Client` as the dashboard reads them."""

from __future__ import annotations

import time
import uuid

from celery_ext.client import Client


class Out:
    """Timestamped event lines; on a terminal a redrawn screen with the last of them."""

    def __init__(self, header: list[str], tty: bool) -> None:
        self.header = header
        self.tty = tty
        self.started = time.monotonic()
        self.events: list[str] = []

    def event(self, text: str) -> None:
        line = f"[{time.monotonic() - self.started:6.1f}s] {text}"
        self.events.append(line)
        if not self.tty:
            print(line, flush=True)

    def screen(self, body: list[str]) -> None:
        if self.tty:
            lines = [*self.header, "", *body, "", *self.events[-12:]]
            print("\033[H\033[J" + "\n".join(lines), flush=True)


def job_label(name: str, job_id: str) -> str:
    """A job as the demo's output names it: ``<last part of the job name>[<id>]``.

    A Celery UUID is cut to its first 8 hex digits (enough to tell apart the few jobs a
    pool owns); any other id, such as the unique jobs' ``refresh-<n>-<attempt>``, is
    shown whole, since its first characters are shared by every job of its kind."""
    try:
        short = str(uuid.UUID(job_id))[:8]
    except ValueError:
        short = job_id
    return f"{name.split('.')[-1]}[{short}]"


def status_lines(client: Client, prefix: str) -> list[str]:
    """Queues of the jobs named ``prefix...``, pools, busy workers and periodic jobs."""
    lines = [f"{'job queue':20} {'queued':>6} {'in flight':>9} {'done':>6} {'failed':>6}"]
    for q in client.job_queues(prefix=prefix):
        lines.append(f"{q['name'].removeprefix(prefix):20} {q['size']:>6} "
                     f"{q['in_flight']:>9} {q['processed']:>6} {q['failed']:>6}")
    lines.append("")
    for p in client.worker_pools():
        lines.append(f"pool {p['node']:24} {p['state']:8} in flight {p['in_flight']}")
    busy = client.busy_workers()
    lines.append(f"busy workers: {len(busy)}")
    for b in busy[:8]:
        progress = f"{b['progress'] * 100:5.1f}%" if b["progress"] is not None else "   -  "
        lines.append(f"  {b['job_name'].removeprefix(prefix):20} {progress} "
                     f"{b['checkin_message'] or ''}")
    for e in client.periodic():
        lines.append(f"periodic {e['name']} ({e['schedule']}): {e['runs']} run(s), "
                     f"last {e['last_outcome'] or '-'}")
    return lines


def finished(client: Client, prefix: str) -> int:
    """Jobs named ``prefix...`` that finished (done or failed) so far."""
    return sum(q["processed"] + q["failed"] for q in client.job_queues(prefix=prefix))


def periodic_runs(client: Client) -> int:
    """Runs of the periodic entries enqueued so far and run, all entries together: every
    run but the last, and the last once the worker recorded its outcome."""
    return sum(max(0, e["runs"] - (e["last_outcome"] in (None, "pending")))
               for e in client.periodic())


def summary(client: Client, prefix: str) -> str:
    """One line: totals over the jobs named ``prefix...``, the sets and the pools."""
    queues = client.job_queues(prefix=prefix)
    sets = client.counts()
    pools = client.worker_pools()
    return (f"queued {sum(q['size'] for q in queues)}  "
            f"in flight {sum(q['in_flight'] for q in queues)}  "
            f"done {sum(q['processed'] for q in queues)}  scheduled {sets['scheduled']}  "
            f"retry {sets['retry']}  dead {sets['dead']}  periodic runs {periodic_runs(client)}"
            "  pools " + ", ".join(f"{p['node'].split('@')[0]}:{p['state']}" for p in pools))
