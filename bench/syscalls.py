"""The drain's kernel side: system calls and kernel CPU per job, stock, ours and Dramatiq.

``bench.profile --gil`` counts the worker's sampled Python by layer and leaves the rest
of its CPU unexplained: the kernel's work in system calls (loopback sends and reads,
polls, pipes to prefork children) and the samples py-spy did not take. This module
measures the kernel's part on its own.

``python -m bench.syscalls [--pools prefork,solo-x2,threads-2x8] [--modes stock,ours,dramatiq]
[--jobs 20000] [--window 1.5]`` drains the same pre-queued no-op jobs as ``python -m bench``
(acks late) and, once a fifth of them are done, measures each side in two windows:

1. untraced: jobs/s, and the user and system (kernel) CPU per job of the processes the
   harness started (the ``celery worker`` main processes; Dramatiq's supervisor) and of
   their descendants (prefork children; Dramatiq's worker processes), from psutil;
2. traced by ``strace -c -f`` on the same processes and all their threads: system calls
   per job, by name. Tracing slows every call, so its times are not used, only its counts.

Needs ``strace`` (Debian's package) and ptrace permission.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench import app as bench_app
from bench.harness import DRAMATIQ, MODES, REPO_ROOT, Bench, Proc, ProcGroup
from bench.workloads import POOLS, fill, log

OUT = REPO_ROOT / "bench" / "results" / "syscalls"
#: The share of the jobs done before the windows open (startup and warm-up left out).
WARMUP_SHARE = 0.2
#: System calls listed by name per side and process role; the rest are summed.
TOP = 8


def parse_strace_summary(text: str) -> dict[str, int]:
    """``strace -c`` summary -> calls per system call name (the "total" row left out).

    Rows are ``% time, seconds, usecs/call, calls, [errors,] syscall``: the errors column
    is empty for a call that never failed."""
    calls: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) not in (5, 6) or parts[-1] == "total" or parts[-1] == "syscall":
            continue
        try:
            float(parts[0])
            count = int(parts[3])
        except ValueError:
            continue
        calls[parts[-1]] = calls.get(parts[-1], 0) + count
    return calls


@dataclass
class Role:
    """One role's processes in a side (``main``: those the harness started; ``children``:
    their descendants) and what the two windows measured of them."""

    pids: list[int]
    user_us: float = 0.0
    sys_us: float = 0.0
    calls: dict[str, float] = field(default_factory=dict)

    def cpu(self) -> tuple[float, float]:
        """User and system CPU seconds of these processes (all their threads)."""
        user = system = 0.0
        for pid in self.pids:
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.NoSuchProcess:
                continue
            user, system = user + times.user, system + times.system
        return user, system

    def per_job_line(self, name: str) -> str:
        total = sum(self.calls.values())
        top = sorted(self.calls.items(), key=lambda kv: -kv[1])[:TOP]
        rest = total - sum(v for _, v in top)
        names = ", ".join(f"{k} {v:.2f}" for k, v in top)
        return (f"    {name}: user {self.user_us:.0f} us/job, kernel {self.sys_us:.0f} us/job; "
                f"{total:.1f} system calls/job ({names}{f', other {rest:.2f}' if rest else ''})")


def roles_of(worker: Proc | ProcGroup) -> tuple[Role, Role]:
    procs = worker.procs if isinstance(worker, ProcGroup) else [worker]
    children = [c.pid for p in procs for c in p.tree()[1:]]
    return Role([p.pid for p in procs]), Role(children)


def measure(bench: Bench, side: str, worker: Proc | ProcGroup, n: int, window: float,
            strace: str, out: Path) -> dict[str, Any]:
    """Start ``worker`` on the restored queue and measure both windows (see the module)."""
    def done() -> int:
        return int(bench.counter.get(bench_app.COUNTER_KEY) or 0)

    worker.start()
    try:
        bench.wait_count(worker, int(n * WARMUP_SHARE), timeout=60)
        roles = roles_of(worker)
        before = [r.cpu() for r in roles]
        d0, t0 = done(), time.perf_counter()
        time.sleep(window)
        d1, t1 = done(), time.perf_counter()
        after = [r.cpu() for r in roles]
        jobs = max(1, d1 - d0)
        for role, (u0, s0), (u1, s1) in zip(roles, before, after, strict=True):
            role.user_us, role.sys_us = (u1 - u0) / jobs * 1e6, (s1 - s0) / jobs * 1e6
        tracers = []
        for role, name in zip(roles, ("main", "children"), strict=True):
            if role.pids:
                path = out / f"strace-{side}-{name}.txt"
                argv = [strace, "-c", "-f", "-o", str(path)]
                for pid in role.pids:
                    argv += ["-p", str(pid)]
                tracers.append((role, path, subprocess.Popen(
                    argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        time.sleep(0.3)  # attached to every thread
        d2 = done()
        time.sleep(window)
        d3 = done()
        for _, _, tracer in tracers:
            tracer.send_signal(signal.SIGINT)
        traced = max(1, d3 - d2)
        for role, path, tracer in tracers:
            tracer.wait(30)
            if not path.exists():
                raise RuntimeError(f"{side}: strace wrote no summary (exit {tracer.returncode}); "
                                   "it needs ptrace permission over the workers")
            role.calls = {k: v / traced for k, v in
                          parse_strace_summary(path.read_text(errors="replace")).items()}
        if d3 >= n:
            log(f"  {side}: the queue ran dry during the traced window; use more --jobs")
        return {"jobs_per_s": jobs / (t1 - t0), "roles": roles}
    finally:
        worker.stop()
        bench.flush()


def report(side: str, res: dict[str, Any]) -> list[str]:
    main, children = res["roles"]
    lines = [f"  {side}: {res['jobs_per_s']:.0f} jobs/s untraced"]
    lines.append(main.per_job_line("main"))
    if children.pids:
        lines.append(children.per_job_line("children"))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.syscalls", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pools", default="prefork,solo-x2,threads-2x8",
                   help=f"subset of {', '.join(POOLS)}")
    p.add_argument("--modes", default="stock,ours,dramatiq")
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--window", type=float, default=1.5, help="seconds of each window")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    strace = shutil.which("strace")
    if strace is None:
        print("strace not found: apt-get install strace", file=sys.stderr)
        return 2
    pools = [x for x in args.pools.split(",") if x]
    modes = [m for m in args.modes.split(",") if m in (*MODES, DRAMATIQ)]
    bad = [x for x in pools if x not in POOLS]
    if bad:
        print(f"unknown pools {bad}: choose from {', '.join(POOLS)}", file=sys.stderr)
        return 2
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"drain, acks late, {args.jobs} jobs; windows of {args.window:g} s after "
             f"{WARMUP_SHARE:.0%} of the jobs; per job:"]
    with Bench.open(out / "logs") as bench:
        fill(bench, args.jobs, modes=tuple(modes))
        for pool_name in pools:
            size = POOLS[pool_name]
            lines.append(f"{size}:")
            for mode in (m for m in modes if m != DRAMATIQ):
                bench.restore(mode)
                worker = bench.workers(mode, size.pool, size.concurrency, size.processes,
                                       acks_late=1)
                lines += report(mode, measure(bench, f"{mode}-{pool_name}", worker,
                                              args.jobs, args.window, strace, out))
                log(lines[-1])
        if DRAMATIQ in modes:
            from bench import dramatiq_app

            lines.append(f"dramatiq --processes {dramatiq_app.PROCESSES} "
                         f"--threads {dramatiq_app.THREADS}:")
            bench.restore(DRAMATIQ)
            lines += report(DRAMATIQ, measure(bench, DRAMATIQ, bench.dramatiq_worker(),
                                              args.jobs, args.window, strace, out))
    text = "\n".join(lines)
    (out / "report.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
