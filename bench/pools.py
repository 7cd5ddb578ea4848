"""``python -m bench.pools``: 1, 10, 50 and 200 worker pools, idle and busy (issue 36).

Per side (stock first, then ours), one fresh server (AOF off) and one job name
(``bench.job_0000``, the no-op job of ``bench.app``). A pool is one ``celery worker -P
solo`` process (one job at a time, no child processes: the smallest pool Celery has, so
200 fit in memory), acks late, started without mingle, gossip or heartbeat events, as
every benchmark worker is. The pools are added level by level (``--levels``: 1, then 9
more, then 40, then 150), in batches of ``--batch`` started together, each batch waited
for before the next (each worker announces itself from ``worker_ready``); then every pool
must answer ``celery inspect ping`` before anything is measured. At each level:

- **idle**: after ``--settle`` seconds, a window of ``--idle-seconds``: commands the server
  ran per second (``INFO commandstats``, without the harness's own ``INFO``) and Redis CPU
  (``INFO cpu``), per pool, and which commands they are;
- **busy**: ``--jobs`` no-op jobs released at once and drained by all the pools: jobs/s
  (release to the last completion), Redis CPU per job, commands per job (without the
  harness's polling ``GET`` and the jobs' own counting ``INCR``). The jobs are queued
  before they are released, outside the measurement: ours with ``apply_many`` into the
  job queue paused by ``Client.pause`` and released by ``Client.resume`` (which wakes
  idle pools); stock with a pipelined ``LPUSH`` of messages ``apply_async`` built (see
  ``bench.backlog``) into a side list, released by one ``RENAME`` onto the queue.

RSS per pool (the main process's, solo has no children) is read at each level.

    python -m bench.pools                    # 1, 10, 50, 200 pools; ~20 min on 2 cores
    python -m bench.pools --quick            # 1, 2, 4 pools, tiny windows

Prints a table (settings, load average, commit and time at the end) and writes
``<out>/pools.json`` and ``<out>/pools.png`` (``--save-chart`` also copies the chart to
``bench/pools.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from celery import Celery

from bench import app as bench_app
from bench.backlog import (
    JOB,
    SLOWLOG_LEN,
    calls_by_name,
    fill_ours,
    fill_stock,
    git_commit,
    make_app,
    stock_template,
)
from bench.harness import (
    MODES,
    Bench,
    BenchError,
    CommandCounter,
    Proc,
    ProcGroup,
    counts_delta,
)
from bench.report import Panel, side_curves
from celery_ext.client import Client

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
FULL_LEVELS = (1, 10, 50, 200)
QUICK_LEVELS = (1, 2, 4)
#: The pool: one solo worker process, acks late.
POOL, CONCURRENCY = "solo", 1
#: Stock's side list the busy jobs wait in until one RENAME releases them.
HOLD_KEY = "bench:hold"
#: Commands the harness itself sends while it measures (left out of every count), and the
#: jobs' own completion counter (the same for both sides, left out of the busy counts).
HARNESS_COMMANDS = ("info", "get")
JOB_COMMANDS = ("incrby",)
#: How long every pool has to answer ``inspect ping``, and how long one ping waits.
PING_TIMEOUT = 120.0
PING_ROUND = 5.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def start_pools(bench: Bench, mode: str, count: int, batch: int) -> list[Proc]:
    """``count`` more pools, ``batch`` at a time, each batch ready before the next."""
    started: list[Proc] = []
    while len(started) < count:
        procs = [bench.worker(mode, POOL, CONCURRENCY, acks_late=1)
                 for _ in range(min(batch, count - len(started)))]
        for proc in procs:
            proc.start()
        for proc in procs:
            bench.wait_ready(proc, timeout=120 + 2 * len(procs))
        started += procs
    return started


def ping_all(app: Celery, expected: int) -> dict[str, Any]:
    """Ask ``inspect ping`` until every pool has answered (a broadcast reaches only the
    pools subscribed when it is sent, so it is sent again, every ``PING_ROUND`` seconds);
    fails after ``PING_TIMEOUT``. Returns how long it took and how many rounds."""
    answered: set[str] = set()
    t0 = time.perf_counter()
    rounds = 0
    while len(answered) < expected:
        if time.perf_counter() - t0 > PING_TIMEOUT:
            raise BenchError(f"only {len(answered)} of {expected} pools answered inspect "
                             f"ping in {PING_TIMEOUT:.0f} s")
        rounds += 1
        for reply in app.control.ping(timeout=PING_ROUND, limit=expected):
            answered.update(reply)
    return {"answered": len(answered), "seconds": time.perf_counter() - t0, "rounds": rounds}


def idle(bench: Bench, pools: int, seconds: float, monitor_seconds: float,
         baseline: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per pool over an idle window: the commands the server ran (commandstats: a script's
    own calls count too) and its CPU, then, over a shorter window with MONITOR on (which
    costs the server CPU of its own), the commands the pools sent. ``baseline`` (the same
    window with no pool) is the server's own CPU (its cron), taken off before dividing."""
    stats0, cpu0 = bench.commandstats(), bench.redis_cpu()
    time.sleep(seconds)
    stats1, cpu1 = bench.commandstats(), bench.redis_cpu()
    calls = counts_delta(stats0, stats1, skip=HARNESS_COMMANDS)
    with CommandCounter(bench.server) as counter:
        time.sleep(monitor_seconds)
    sent = {k: v for k, v in counter.sent.items() if k not in (*HARNESS_COMMANDS, "monitor")}
    cpu_per_s = (cpu1 - cpu0) / seconds * 1e6
    own = baseline["redis_cpu_us_per_s"] if baseline else 0.0
    n = max(pools, 1)
    return {"seconds": seconds, "monitor_seconds": monitor_seconds,
            "redis_cpu_us_per_s": cpu_per_s,
            "redis_cpu_us_per_s_per_pool": (cpu_per_s - own) / n,
            "executed_per_s_per_pool": sum(calls.values()) / seconds / n,
            "sent_per_s_per_pool": sum(sent.values()) / monitor_seconds / n,
            "executed_by_command": {k: round(v / seconds / n, 3) for k, v in
                                    sorted(calls.items(), key=lambda kv: -kv[1])},
            "sent_by_command": {k: round(v / monitor_seconds / n, 3) for k, v in
                                sorted(sent.items(), key=lambda kv: -kv[1])}}


def busy(bench: Bench, group: ProcGroup, jobs: int, app: Celery,
         template: tuple[bytes, bytes, bytes] | None, steer: Client | None,
         slowlog: bool = False) -> dict[str, Any]:
    """``jobs`` jobs queued while held, released at once, drained by every pool;
    ``slowlog``: SLOWLOG records every call meanwhile (threshold 0), for the time inside
    Redis per job of each command and each of our scripts."""
    client = bench.client()
    bench.counter.delete(bench_app.COUNTER_KEY)
    if template is not None:
        fill_stock(client, template, jobs, key=HOLD_KEY)
    else:
        assert steer is not None
        steer.pause(JOB)
        fill_ours(app, jobs)
    time.sleep(0.5)  # what the fill left to do in the background (wake-ups) is done
    if slowlog:
        client.config_set("slowlog-max-len", SLOWLOG_LEN)
        client.config_set("slowlog-log-slower-than", 0)
        client.slowlog_reset()
    stats0, cpu0 = bench.commandstats(), bench.redis_cpu()
    t0 = time.perf_counter()
    if template is not None:
        client.rename(HOLD_KEY, JOB)
    else:
        assert steer is not None
        steer.resume(JOB)
    first, t1 = bench.wait_count(group, jobs, timeout=120 + jobs / 20)
    stats1, cpu1 = bench.commandstats(), bench.redis_cpu()
    calls = counts_delta(stats0, stats1, skip=HARNESS_COMMANDS + JOB_COMMANDS)
    inside: dict[str, dict[str, float]] = {}
    if slowlog:
        client.config_set("slowlog-log-slower-than", 10_000)
        by_name = calls_by_name(client.slowlog_get(SLOWLOG_LEN))
        client.slowlog_reset()
        inside = {name: {"calls_per_job": round(n / jobs, 3), "us_per_job": round(us / jobs, 2)}
                  for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])
                  if name not in HARNESS_COMMANDS + JOB_COMMANDS + ("slowlog", "config")}
    return {"jobs": jobs, "jobs_per_s": jobs / (t1 - t0), "first_s": first - t0,
            "redis_cpu_us_per_job": (cpu1 - cpu0) / jobs * 1e6,
            "executed_per_job": sum(calls.values()) / jobs,
            "executed_by_command": {k: round(v / jobs, 3) for k, v in
                                    sorted(calls.items(), key=lambda kv: -kv[1])},
            "inside_redis_by_call": inside}


def run_side(bench: Bench, mode: str, levels: Sequence[int], args: argparse.Namespace
             ) -> dict[str, Any]:
    """Every level of one side on ``bench``'s fresh server; the pools stay up from one
    level to the next and are stopped at the end."""
    url = bench.server.url(scheme="celery-ext" if mode == "ours" else "redis", db=0)
    app = make_app(mode, url)
    template = stock_template(url, bench.client()) if mode == "stock" else None
    bench.flushall()
    steer = None
    if mode == "ours":
        # The harness's own client, its scripts loaded now: pausing and resuming the
        # queue then costs one call each inside the measurement.
        steer = Client.from_url(url)
        steer.scripts.load_all()
    pools: list[Proc] = []
    points: list[dict[str, Any]] = []
    baseline = idle(bench, 0, args.idle_seconds, args.monitor_seconds)
    log(f"  {mode}, no pool: the server's own {baseline['redis_cpu_us_per_s']:.0f} us/s CPU")
    try:
        for level in levels:
            t0 = time.perf_counter()
            pools += start_pools(bench, mode, level - len(pools), args.batch)
            start_s = time.perf_counter() - t0
            ping = ping_all(app, level)
            group = ProcGroup(pools)
            usage = group.usage()
            time.sleep(args.settle)
            point: dict[str, Any] = {
                "pools": level, "start_s": start_s, "ping": ping,
                "rss_mib_per_pool": usage["rss_tree"] / level / 2**20,
                "idle": idle(bench, level, args.idle_seconds, args.monitor_seconds, baseline),
                "busy": busy(bench, group, args.jobs, app, template, steer, args.slowlog),
                "loadavg": [round(x, 2) for x in os.getloadavg()]}
            i, b = point["idle"], point["busy"]
            log(f"  {mode}, {level} pools (started in {start_s:.0f} s, all answered ping in "
                f"{ping['seconds']:.1f} s, RSS "
                f"{point['rss_mib_per_pool']:.0f} MiB each): idle "
                f"{i['sent_per_s_per_pool']:.2f} commands/s sent "
                f"({i['executed_per_s_per_pool']:.2f} run) and "
                f"{i['redis_cpu_us_per_s_per_pool']:.0f} us/s Redis CPU per pool; busy "
                f"{b['jobs_per_s']:.0f} jobs/s, {b['redis_cpu_us_per_job']:.0f} us Redis CPU "
                f"and {b['executed_per_job']:.2f} commands run per job; load {point['loadavg'][0]}")
            points.append(point)
    finally:
        for proc in pools:
            proc.stop()
        app.close()
        if steer is not None:
            steer.client.close()
    return {"baseline": baseline, "points": points}


# -- report ---------------------------------------------------------------------------------
def table(res: dict[str, Any]) -> str:
    lines = ["| side | pools | RSS MiB/pool | idle commands/s sent per pool | idle commands/s "
             "run per pool | idle Redis CPU µs/s per pool | busy jobs/s | busy Redis CPU "
             "µs/job | busy commands run/job |", "|---|---|---|---|---|---|---|---|---|"]
    for mode, side in res["sides"].items():
        for p in side["points"]:
            i, b = p["idle"], p["busy"]
            lines.append(f"| {mode} | {p['pools']} | {p['rss_mib_per_pool']:.0f} | "
                         f"{i['sent_per_s_per_pool']:.2f} | {i['executed_per_s_per_pool']:.2f} | "
                         f"{i['redis_cpu_us_per_s_per_pool']:.0f} | {b['jobs_per_s']:,.0f} | "
                         f"{b['redis_cpu_us_per_job']:.0f} | {b['executed_per_job']:.2f} |")
    lines += ["", "Idle, per pool per second at the most pools, sent (MONITOR) / run "
              "(commandstats, a script's own calls included):"]
    for mode, side in res["sides"].items():
        top = side["points"][-1]["idle"]
        for what in ("sent", "executed"):
            lines.append(f"- {mode}, {what}: " + ", ".join(
                f"{k} {v:g}" for k, v in top[f"{what}_by_command"].items()))
    lines += ["", "Busy, commands run per job at the most pools (a script's own calls "
              "included):"]
    for mode, side in res["sides"].items():
        lines.append(f"- {mode}: " + ", ".join(
            f"{k} {v:g}" for k, v in side["points"][-1]["busy"]["executed_by_command"].items()))
    for mode, side in res["sides"].items():
        inside = side["points"][-1]["busy"].get("inside_redis_by_call")
        if inside:
            lines.append(f"- {mode}, inside Redis per job by call (SLOWLOG): " + ", ".join(
                f"{k} {v['us_per_job']:g} µs ({v['calls_per_job']:g} calls)"
                for k, v in inside.items() if v["us_per_job"] >= 0.5))
    s = res["settings"]
    own = ", ".join(f"{m} {side['baseline']['redis_cpu_us_per_s']:.0f}"
                    for m, side in res["sides"].items())
    lines += ["", f"Settings: pools {', '.join(map(str, s['levels']))}, each `celery worker "
              f"-P {POOL}` (-c {CONCURRENCY}), acks late, no mingle/gossip/heartbeat events, "
              f"started {s['batch']} at a time, every one answering inspect ping; idle window "
              f"{s['idle_seconds']:g} s (commandstats, CPU) and {s['monitor_seconds']:g} s "
              f"(MONITOR) after {s['settle']:g} s, Redis CPU per pool net of the server's own "
              f"with no pool (µs/s: {own}); busy {s['jobs']:,} no-op jobs (ours apply_many "
              f"into a paused queue, resumed; stock LPUSH into a side list, RENAMEd); one "
              f"fresh server per side ({s['server']}, AOF off), stock first. Commit "
              f"{s['commit']}, {s['started']}; load average before {s['load_before']}, after "
              f"{s['load_after']}."]
    return "\n".join(lines)


def chart(path: Path, res: dict[str, Any]) -> bool:
    """Four panels against the pool count (log scale): idle commands/s and Redis CPU per
    pool, busy jobs/s and Redis CPU per job. False without matplotlib."""
    panels: list[Panel] = [
        ("idle: commands/s sent per pool", lambda p: p["idle"]["sent_per_s_per_pool"], False),
        ("idle: Redis CPU µs/s per pool",
         lambda p: p["idle"]["redis_cpu_us_per_s_per_pool"], False),
        ("busy: jobs/s", lambda p: p["busy"]["jobs_per_s"], False),
        ("busy: Redis CPU µs/job", lambda p: p["busy"]["redis_cpu_us_per_job"], False)]
    return side_curves(path, res, panels, "pools", "worker pools (log scale)",
                       f"Worker pools, -P {POOL} each (bench.pools)", log_x=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pools", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1, 2, 4 pools, tiny windows")
    p.add_argument("--levels", default="", help="comma-separated pool counts, rising")
    p.add_argument("--jobs", type=int, default=None, help="busy jobs (20,000; quick 200)")
    p.add_argument("--idle-seconds", type=float, default=None, help="idle window (30; quick 3)")
    p.add_argument("--monitor-seconds", type=float, default=None,
                   help="idle window with MONITOR on (10; quick 2)")
    p.add_argument("--settle", type=float, default=None,
                   help="seconds after the last pool is ready (10; quick 2)")
    p.add_argument("--slowlog", action="store_true",
                   help="SLOWLOG every call of the busy drain: time inside Redis by call")
    p.add_argument("--batch", type=int, default=10, help="pools started at a time")
    p.add_argument("--modes", default=",".join(MODES), help="stock,ours")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--save-chart", action="store_true",
                   help="also copy the chart to bench/pools.png")
    args = p.parse_args(argv)
    levels = (tuple(int(x) for x in args.levels.split(",")) if args.levels
              else QUICK_LEVELS if args.quick else FULL_LEVELS)
    if not levels or levels[0] < 1 or list(levels) != sorted(set(levels)):
        p.error("--levels must be rising pool counts from 1")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes takes {', '.join(MODES)}")
    args.jobs = args.jobs or (200 if args.quick else 20_000)
    args.idle_seconds = args.idle_seconds or (3.0 if args.quick else 30.0)
    args.monitor_seconds = args.monitor_seconds or (2.0 if args.quick else 10.0)
    args.settle = args.settle if args.settle is not None else (2.0 if args.quick else 10.0)
    settings: dict[str, Any] = {
        "levels": list(levels), "jobs": args.jobs, "idle_seconds": args.idle_seconds,
        "monitor_seconds": args.monitor_seconds, "settle": args.settle, "batch": args.batch,
        "pool": f"{POOL} -c {CONCURRENCY}", "slowlog": args.slowlog,
        "commit": git_commit(), "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": [round(x, 2) for x in os.getloadavg()]}
    res: dict[str, Any] = {"settings": settings, "sides": {}}
    for mode in modes:
        log(f"[pools] {mode}: levels {list(levels)}, {args.jobs} busy jobs")
        with Bench.open(args.out / "logs") as bench:
            settings["server"] = bench.server_version()
            res["sides"][mode] = run_side(bench, mode, levels, args)
    settings["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(table(res))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pools.json").write_text(json.dumps(res, indent=2))
    png = args.out / "pools.png"
    if chart(png, res):
        log(f"chart: {png}")
        if args.save_chart:
            shutil.copyfile(png, Path(__file__).resolve().parent / "pools.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
