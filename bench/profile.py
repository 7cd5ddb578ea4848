"""Profile the drain workload: py-spy on the worker, commandstats and SLOWLOG on Redis.

``python -m bench.profile [--modes ours,stock] [--jobs 20000] [--pool prefork]
[--acks early]`` pre-fills the queue, starts a worker, samples it with
``py-spy record`` (main process and prefork children, non-blocking) from its first
completed job until the last, and prints, per mode:

- the worker main process's and the children's hottest functions, inclusive and
  self, as % of samples;
- Redis ``INFO commandstats`` deltas per job (calls, µs) and the slowest entries of
  ``SLOWLOG`` (threshold ``--slowlog-us``).

``python -m bench.profile --enqueue [--jobs 5000] [--backend] [--top 30]`` profiles the
producer instead: cProfile (CPU clock) of ``apply_async`` in a ``bench.client`` process
for stock, ours with ``install(app)`` and ours drop-in, with the enqueue workload's
settings, and prints each side's CPU per job (unprofiled), its CPU by layer (the whole
call, Celery alone with the publish replaced by a no-op, and for ours everything but the
round trip; ``bench.client layers``) and its hottest functions.

Raw stacks and the report go to ``bench/results/profile/``. Needs ``py-spy``
(``pip install py-spy``) and ptrace permission; ``--no-pyspy`` keeps the Redis side.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness import MODES, REPO_ROOT, Bench, counts_delta
from bench.workloads import POOLS, fill, log

OUT = REPO_ROOT / "bench" / "results" / "profile"
#: SLOWLOG ring size during a profile (the most recent entries are kept).
SLOWLOG_LEN = 50_000
_PROCESS = re.compile(r"^process (\d+):")


def _pyspy() -> str | None:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return found if Path(found).exists() else None


def parse_stacks(path: Path, main_pid: int) -> dict[str, dict[str, Counter[str]]]:
    """py-spy raw output -> {"main"|"children": {"total", "self", "incl", "package"}}."""
    out: dict[str, dict[str, Counter[str]]] = {}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        count = int(count_s)
        frames = stack.split(";")
        who = "main"
        while frames and (m := _PROCESS.match(frames[0])):
            who = "main" if int(m.group(1)) == main_pid else "children"
            frames = frames[1:]
        frames = [f for f in frames if not f.startswith("thread ")]
        if not frames:
            continue
        bucket = out.setdefault(who, {"total": Counter(), "self": Counter(), "incl": Counter(),
                                      "package": Counter(), "layer": Counter()})
        bucket["total"]["samples"] += count
        bucket["layer"][layer_of(frames)] += count
        bucket["self"][frames[-1]] += count
        bucket["package"][_package(frames[-1])] += count
        for frame in set(frames):
            bucket["incl"][frame] += count
    return out


#: The worker's per-job path in layers, for ``layer_of``: (layer, frame-name prefixes; a
#: prefix with a "/" in it matches a file path instead). Stock's and ours' functions share
#: these names where the layer is Kombu's or Celery's.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("job body (the task's code: one INCRBY)", ("bench/app.py",)),
    ("bench.floor's strategy (--floor 1 or 2)", ("strategy.<locals>.", "kept_strategy.",
                                                 "_acker", "RunningJob.")),
    ("acks", ("Request.acknowledge", "Consumer.call_soon_ack", "WorkerPool.flush_acks",
              "AckBatcher.", "WorkerPool._write_ack_batch", "WorkerPool.ack", "AckSender.",
              "Message.ack", "Channel.basic_ack", "QoS.ack", "on_loop_tick")),
    ("task signals and their receivers (task_prerun, task_postrun: ours)", (
        "Signal.send",)),
    ("Celery tracer (request stack, state)", ("build_tracer.<locals>.trace_task",
                                                        "fast_trace_task", "apply_target")),
    ("pool hand-off (billiard's pipes and results; a thread pool's queue)", (
        "BasePool.apply_async", "TaskPool.", "AsynPool.", "ResultHandler.", "ApplyResult.",
        "Pool.apply_async", "ThreadPoolExecutor.submit", "billiard/")),
    ("Celery strategy and Request", ("default.<locals>.task_message_handler",
                                     "create_request_cls.<locals>.Request", "Request.",
                                     "WorkController._process_task",
                                     "Consumer.create_task_handler")),
    ("Kombu message and consumer callback", ("Transport._deliver", "Consumer._receive_callback",
                                             "Channel.basic_consume.<locals>._callback",
                                             "Message.__init__")),
    ("fetch: reply read and decoded", ("Channel._brpop_read",)),
    ("fetch: request sent", ("Channel._brpop_start",)),
    ("background threads (heartbeat, observer, reaper)", ("Thread._bootstrap",)),
)
EVENT_LOOP = "event loop and the rest"


def layer_of(frames: Sequence[str]) -> str:
    """The layer of one sampled stack (root first): the innermost frame that names one.
    Acks made inside the tracer count as acks, the job inside it as the job."""
    for frame in reversed(frames):
        name, where = _split(frame)
        for layer, marks in LAYERS:
            if any(where.startswith(m) if "/" in m else name.startswith(m)
                   for m in marks):
                return layer
    return EVENT_LOOP


#: A frame's file path up to its package: site-packages, or this checkout.
_PATH_PREFIX = re.compile(r"^(?:.*/site-packages/|" + re.escape(f"{REPO_ROOT}/") + ")")


def _split(frame: str) -> tuple[str, str]:
    """A frame "name (path/to/pkg/mod.py:12)" -> ("name", "pkg/mod.py:12")."""
    name, _, where = frame.partition(" (")
    return name, _PATH_PREFIX.sub("", where.removesuffix(")"))


def _package(frame: str) -> str:
    """Top-level package of a frame "name (pkg/mod.py:12)"; "stdlib" when it has no dir."""
    path = _split(frame)[1]
    return path.split("/", 1)[0] if "/" in path else "stdlib"


def _short(frame: str) -> str:
    # "name (path/to/site-packages/pkg/mod.py:12)" -> "name (pkg/mod.py:12)"
    name, where = _split(frame)
    return f"{name} ({where})" if where else name


def report_stacks(stacks: dict[str, dict[str, Counter[str]]], top: int,
                  cpu_us: dict[str, float] | None = None,
                  us_per_sample: float | None = None) -> str:
    """Top functions per process kind; inclusive leaves out frames on >= 90 % of samples
    (the event loop and everything above it). First the samples by layer, in µs per job
    when ``cpu_us`` gives the CPU per job of the "main" process and of the "children":
    each layer's share of that CPU; or, for samples taken only while holding the GIL,
    ``us_per_sample`` (sampling interval / jobs) times its samples. The rest of the CPU is
    not in the samples: the kernel's time in system calls, and the samples py-spy did not
    take (in a solo drain on 2 cores it took about half as many as its rate asks).
    ``bench.syscalls`` measures the kernel's share alone (psutil's system time): 40-65 µs
    per job for ours."""
    lines = []
    for who in ("main", "children"):
        bucket = stacks.get(who)
        if not bucket:
            continue
        total = bucket["total"]["samples"]
        lines.append(f"  {who} process{'es' if who == 'children' else ''}: {total} samples")
        per_job = (cpu_us or {}).get(who)
        lines.append("    by layer" + (f" (of {per_job:.0f} us CPU per job):" if per_job else ":"))
        for layer, n in bucket["layer"].most_common():
            share = n / total
            us = (n * us_per_sample if us_per_sample else
                  share * per_job if per_job else None)
            lines.append(f"      {100.0 * share:5.1f}%  "
                         + (f"{us:6.0f} us  " if us is not None else "") + layer)
        if us_per_sample and per_job:
            lines.append(f"              {per_job - total * us_per_sample:6.0f} us  CPU not "
                         "sampled (kernel time and missed samples; bench.syscalls)")
        pkgs = ", ".join(f"{k} {100.0 * n / total:.0f}%"
                         for k, n in bucket["package"].most_common(8))
        lines.append(f"    self time by package: {pkgs}")
        incl = [(f, n) for f, n in bucket["incl"].most_common() if n < 0.9 * total][:top]
        lines.append("    top inclusive (below the event loop):")
        lines += [f"      {100.0 * n / total:5.1f}%  {_short(f)}" for f, n in incl]
        lines.append("    top self:")
        lines += [f"      {100.0 * n / total:5.1f}%  {_short(f)}"
                  for f, n in bucket["self"].most_common(top)]
    return "\n".join(lines)


def profile_mode(bench: Bench, mode: str, pool: str, conc: int, n: int, acks_late: bool,
                 out: Path, rate: int, slowlog_us: int, pyspy: str | None,
                 top: int, names: int = 1, gil: bool = False, floor: int = 0) -> str:
    """Drain ``n`` pre-filled jobs once under the profilers; returns the report text."""
    bench.restore(mode)
    admin = bench.client()
    admin.config_set("slowlog-log-slower-than", slowlog_us)
    admin.config_set("slowlog-max-len", SLOWLOG_LEN)
    admin.slowlog_reset()
    stats0 = dict(admin.info("commandstats"))
    worker = bench.worker(mode, pool, conc, acks_late=int(acks_late), names=names,
                          floor=floor)
    raw = (out / f"{mode}-{pool}-{'late' if acks_late else 'early'}-{names}"
           f"{f'-floor{floor}' if floor else ''}.pyspy.txt")
    spy: subprocess.Popen[bytes] | None = None
    t0 = time.perf_counter()
    worker.start()
    at_first: dict[str, Any] = {}
    try:
        def on_first(done: int) -> None:
            nonlocal spy
            at_first.update(done=done, usage=worker.usage())
            if pyspy:
                spy = subprocess.Popen(
                    [pyspy, "record", "--pid", str(worker.pid), "--subprocesses",
                     "--nonblocking", "--function", "--format", "raw", "--rate", str(rate),
                     *(["--gil"] if gil else []), "-o", str(raw)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        first, t1 = bench.wait_count(worker, n, timeout=120 + n / 20, on_first=on_first)
        usage = worker.usage()
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()
        worker.stop()
    stats1 = dict(admin.info("commandstats"))
    slow = admin.slowlog_get(SLOWLOG_LEN)
    admin.config_set("slowlog-log-slower-than", 10_000)
    admin.slowlog_reset()

    lines = [f"== {mode}: {pool} -c {conc}, acks {'late' if acks_late else 'early'}, "
             f"{names} job name{'s' if names > 1 else ''}, "
             f"{n} jobs: {n / (t1 - t0):.0f} jobs/s from start "
             f"(steady {n / max(t1 - first, 1e-6):.0f}/s, under the profiler)"]
    steady = max(1, n - at_first["done"])
    used = {k: (usage[k] - at_first["usage"][k]) / steady * 1e6 for k in ("cpu_main", "cpu_tree")}
    cpu_us = {"main": used["cpu_main"], "children": used["cpu_tree"] - used["cpu_main"]}
    lines.append(f"  worker CPU per job from the first completion, under the profiler: main "
                 f"process {cpu_us['main']:.0f} us"
                 + (f", children {cpu_us['children']:.0f} us" if pool == "prefork" else ""))
    if pyspy and raw.exists():
        lines.append(report_stacks(parse_stacks(raw, worker.pid), top, cpu_us,
                                   1e6 / rate / steady if gil else None))
    calls = counts_delta({k: v["calls"] for k, v in stats0.items()},
                         {k: v["calls"] for k, v in stats1.items()},
                         skip=("cmdstat_info", "cmdstat_get", "cmdstat_config",
                               "cmdstat_slowlog"))
    usec = {k: stats1[k]["usec"] - stats0.get(k, {}).get("usec", 0) for k in calls}
    total_us = sum(usec.values()) or 1
    lines.append(f"  Redis commandstats per job (total {total_us / n:.1f} us/job of command "
                 "time; commands inside scripts are counted in their script's time too):")
    for k in sorted(calls, key=lambda k: -usec[k]):
        lines.append(f"    {k.removeprefix('cmdstat_'):<22} {calls[k] / n:6.2f} calls/job "
                     f"{usec[k] / n:7.2f} us/job  {100.0 * usec[k] / total_us:5.1f}%")
    lines.append(slowlog_report(
        slow, {k.removeprefix("cmdstat_"): v / n for k, v in calls.items()}, slowlog_us))
    return "\n".join(lines)


def _script_names() -> dict[str, str]:
    from celery_ext.store import scripts

    return {scripts.sha(name): name for name in scripts.SCRIPT_NAMES}


def slowlog_report(entries: list[dict[str, Any]], calls_per_job: dict[str, float],
                   threshold_us: int) -> str:
    """SLOWLOG entries (the most recent ones: it is a ring buffer) grouped by command,
    EVALSHA by script name: share of the sampled calls and mean µs per call. Calls per
    job come from commandstats (EVALSHA split by each script's share of the sample)."""
    names = _script_names()
    calls: Counter[str] = Counter()
    usec: Counter[str] = Counter()
    for entry in entries:
        cmd = entry["command"]
        text = cmd.decode(errors="replace") if isinstance(cmd, bytes) else str(cmd)
        parts = text.split(" ")
        name = parts[0].upper()
        if name in ("INFO", "SLOWLOG", "CONFIG", "GET"):
            continue  # the harness's own
        if name == "EVALSHA" and len(parts) > 1:
            name = f"EVALSHA {names.get(parts[1].lower(), parts[1][:12])}"
        calls[name] += 1
        usec[name] += int(entry["duration"])
    evalsha = sum(n for k, n in calls.items() if k.startswith("EVALSHA")) or 1
    lines = [f"  SLOWLOG (threshold {threshold_us} us, last {len(entries)} entries, commands "
             "run by scripts included; per job = mean x calls/job):"]
    rows = []
    for name, n in calls.items():
        if name.startswith("EVALSHA"):
            per_job = calls_per_job.get("evalsha", 0.0) * n / evalsha
        else:
            per_job = calls_per_job.get(name.lower(), 0.0)
        mean = usec[name] / n
        rows.append((mean * per_job, name, per_job, mean))
    total = sum(r[0] for r in rows) or 1.0
    for us_job, name, per_job, mean in sorted(rows, reverse=True)[:12]:
        lines.append(f"    {name:<24} {per_job:6.2f} calls/job  mean {mean:6.1f} us  "
                     f"{us_job:6.1f} us/job  {100.0 * us_job / total:5.1f}%")
    return "\n".join(lines)


def profile_enqueue(bench: Bench, jobs: int, backend: bool, top: int) -> str:
    """cProfile of ``apply_async`` per side (see ``bench.client profile``)."""
    sides = [("stock", {}), ("ours", {"install": 1}), ("ours", {"install": 0})]
    lines = []
    for mode, extra in sides:
        bench.flush()
        res = bench.run_client(mode, ["profile", "--n", str(jobs), "--top", str(top)],
                               timeout=120 + jobs * 0.05, backend=int(backend), acks_late=1,
                               **extra)
        how = "install(app)" if extra.get("install") else "drop-in"
        label = mode if mode == "stock" else f"ours, {how}"
        lines.append(f"{label}, result backend {'redis' if backend else 'none'}: "
                     f"{res['cpu_us_per_job']:.0f} us CPU per apply_async unprofiled, "
                     f"{res['profiled_cpu_us_per_job']:.0f} under cProfile ({jobs} calls)")
        lay = bench.run_client(mode, ["layers"], timeout=300, backend=int(backend),
                               acks_late=1, **extra)
        lines.append("  us per apply_async by layer (min of 15 batches of 500), CPU / wall: "
                     + ", ".join(f"{k.replace('_', ' ')} {v:.0f} / {lay['wall_us'][k]:.0f}"
                                 for k, v in lay["cpu_us"].items()))
        lines.append("   incl%  self%  calls/job  function")
        lines += [f"  {incl:6.1f} {own:6.1f} {calls:9.1f}  {where}"
                  for incl, own, calls, where in res["rows"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="ours,stock")
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--pool", choices=[k for k, v in POOLS.items() if v.processes == 1],
                   default="prefork")
    p.add_argument("--acks", choices=("early", "late"), default="early")
    p.add_argument("--names", type=int, default=1, help="job names the jobs spread over")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--slowlog-us", type=int, default=0,
                   help="SLOWLOG threshold (0 = every command, to time each script)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--gil", action="store_true",
                   help="sample only threads holding the GIL: the account by layer is then "
                        "in us of CPU per job; the rest is kernel time and missed samples")
    p.add_argument("--floor", type=int, choices=(0, 1, 2), default=0,
                   help="the tasks' strategy: Celery's (0), bench.floor's floor (1) or its "
                        "kept floor (2)")
    p.add_argument("--no-pyspy", action="store_true")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--enqueue", action="store_true",
                   help="profile apply_async in the producer (cProfile) instead of the drain")
    p.add_argument("--backend", action="store_true",
                   help="--enqueue: with a Redis result backend configured")
    args = p.parse_args(argv)
    if args.enqueue:
        with Bench.open(args.out / "logs") as bench:
            text = profile_enqueue(bench, min(args.jobs, 5_000), args.backend, args.top)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"enqueue-{'backend' if args.backend else 'nobackend'}.txt").write_text(text)
        print(text)
        return 0
    modes = [m for m in args.modes.split(",") if m in MODES]
    pyspy = None if args.no_pyspy else _pyspy()
    if not args.no_pyspy and pyspy is None:
        print("py-spy not found: pip install py-spy (or --no-pyspy)", file=sys.stderr)
        return 2
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    pool, conc, _ = POOLS[args.pool]
    reports: list[str] = []
    with Bench.open(out / "logs") as bench:
        fill(bench, args.jobs, names=args.names)
        for mode in modes:
            log(f"[profile] {mode}")
            reports.append(profile_mode(bench, mode, pool, conc, args.jobs, args.acks == "late",
                                        out, args.rate, args.slowlog_us, pyspy, args.top,
                                        args.names, args.gil, args.floor))
    text = "\n\n".join(reports)
    floor = f"-floor{args.floor}" if args.floor else ""
    (out / f"report-{args.pool}-{args.acks}-{args.names}{floor}.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
