"""``python -m bench``: stock Kombu ``redis://`` vs ``celery-ext://``, side by side.

Starts one fresh server, runs each workload for both transports alternating A/B
over ``--rounds``, prints medians and ours/stock, and writes
``bench/results/results.json`` and ``bench/results/chart.png``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

from bench.harness import MODES, REPO_ROOT, Bench, BenchError, stop_all
from bench.names import curve_chart
from bench.report import (
    Row,
    chart,
    load_rows,
    markdown,
    table,
    targets,
    targets_text,
    write_json,
)
from bench.workloads import ACKS, FULL, POOLS, QUICK, WORKLOADS, restrict, settings

DEFAULT_OUT = REPO_ROOT / "bench" / "results"


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=None,
                   help="A/B rounds per configuration (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for development and tests")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated subset of: {', '.join(WORKLOADS)}")
    p.add_argument("--pools", default="", help=f"drain pools subset of {', '.join(POOLS)}")
    p.add_argument("--acks", default="", help=f"drain ack modes subset of {', '.join(ACKS)}")
    p.add_argument("--names", default="", help="many_queues job-name counts, e.g. 1,10,1000")
    p.add_argument("--modes", default="",
                   help="many_queues sides, e.g. ours (stock at 10,000 job names is minutes "
                        "per drain)")
    p.add_argument("--one-name-queues", default="",
                   help="many_queues extras: one job name spread over N queues, e.g. 1000")
    p.add_argument("--jobs", type=int, default=None,
                   help="override the job count of drain, enqueue and many_queues")
    p.add_argument("--idle-seconds", type=float, default=None)
    p.add_argument("--settle", type=float, default=None,
                   help="seconds a ready worker is left idle before the latency and idle "
                        "measurements (default 3; 1 with --quick)")
    p.add_argument("--aof", choices=("no", "everysec", "always"), default="no",
                   help="server persistence (default no: measure the transports, not the disk)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    p.add_argument("--no-chart", action="store_true", help="skip chart.png")
    p.add_argument("--save-chart", action="store_true",
                   help="also copy the chart to bench/chart.png (for the README)")
    p.add_argument("--replot", action="store_true",
                   help="only redraw chart.png (and table.md) from OUT/results.json")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    if rounds < 1:
        print("--rounds must be >= 1", file=sys.stderr)
        return 2
    selected = _csv(args.workloads)
    unknown = [w for w in selected if w not in WORKLOADS]
    if unknown:
        print(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}", file=sys.stderr)
        return 2
    sizes = restrict(QUICK if args.quick else FULL, _csv(args.pools) or None,
                     _csv(args.acks) or None,
                     [int(x) for x in _csv(args.names)] or None,
                     [int(x) for x in _csv(args.one_name_queues)] or None,
                     _csv(args.modes) or None)
    bad = [p for p in sizes.pools if p not in POOLS] + [a for a in sizes.acks if a not in ACKS]
    bad += [m for m in sizes.many_modes if m not in MODES]
    if bad:
        print(f"unknown pools/ack modes {bad}", file=sys.stderr)
        return 2
    if args.jobs:
        sizes = replace(sizes, drain=args.jobs, enqueue=args.jobs, many_jobs=args.jobs)
    if args.idle_seconds:
        sizes = replace(sizes, idle_seconds=args.idle_seconds)
    if args.settle is not None:
        if args.settle < 0:
            print("--settle must be >= 0", file=sys.stderr)
            return 2
        sizes = replace(sizes, idle_settle=args.settle)

    out: Path = args.out
    if args.replot:
        return replot(out, args.save_chart)
    log_dir = out / "logs"
    shutil.rmtree(log_dir, ignore_errors=True)
    json_path = out / "results.json"
    meta: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "argv": list(argv if argv is not None else sys.argv[1:]),
        "rounds": rounds, "quick": args.quick, "aof": args.aof,
        "sizes": sizes.__dict__, "workloads": selected,
        "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in ("celery", "kombu", "redis", "celery-ext",
                                              "dramatiq")},
    }
    rows: list[Row] = []
    details: dict[str, Any] = {}
    if os.getloadavg()[0] > 1.0:
        print(f"warning: load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs: "
              "absolute numbers will be noisy (ratios of the same run still compare)",
              file=sys.stderr)
    t0 = time.monotonic()
    try:
        with Bench.open(log_dir, aof=args.aof) as bench:
            meta["server"] = bench.server_version()
            meta["settings"] = {name: settings(name, sizes) for name in selected}
            for name in selected:
                print(f"[{name}] settings: {meta['settings'][name]}", file=sys.stderr,
                      flush=True)
                w0 = time.monotonic()
                rows += WORKLOADS[name](bench, sizes, rounds, details)
                details.setdefault("seconds", {})[name] = round(time.monotonic() - w0, 1)
                meta["loadavg_after"] = os.getloadavg()
                write_json(json_path, meta, rows, details)
    except BenchError as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        meta["error"] = str(exc)
        write_json(json_path, meta, rows, details)
        return 1
    except KeyboardInterrupt:
        stop_all()
        print("interrupted", file=sys.stderr)
        return 130
    meta["seconds"] = round(time.monotonic() - t0, 1)
    meta["loadavg_after"] = os.getloadavg()
    checks = targets(rows)
    details["targets"] = checks
    write_json(json_path, meta, rows, details)
    (out / "table.md").write_text(markdown(rows) + "\n\n" + settings_text(meta) + "\n")
    print(table(rows))
    print("\n" + settings_text(meta))
    print("\ntargets (ours vs stock and Dramatiq, this run):\n" + targets_text(checks))
    print(f"\nresults: {json_path} (table.md beside it); {meta['seconds']}s, "
          f"load {meta['loadavg_before'][0]:.2f} -> {meta['loadavg_after'][0]:.2f}")
    if not args.no_chart:
        draw(out, rows, meta, args.save_chart)
    return 0


def settings_text(meta: dict[str, Any]) -> str:
    """The settings of every workload of a run, one line each."""
    lines = [f"settings (server {meta.get('server')}, aof {meta.get('aof')}, "
             f"{meta.get('rounds')} rounds):"]
    lines += [f"- {name}: {text}" for name, text in meta.get("settings", {}).items()]
    return "\n".join(lines)


def draw(out: Path, rows: list[Row], meta: dict[str, Any], save_chart: bool) -> None:
    """Write OUT/chart.png (and bench/chart.png with ``save_chart``), and OUT/names.png
    (bench/names.png) when the run has a job-name curve. A run without a stock side
    (``--modes ours``) has no ratio to chart: bench/chart.png is left as it is."""
    title = (f"celery-ext vs stock Kombu redis:// (server {meta.get('server')}, "
             f"{meta.get('rounds')} rounds, {'quick' if meta.get('quick') else 'full'} sizes)")
    png = out / "chart.png"
    if not any(r.primary and r.stock for r in rows):
        print("chart skipped: no stock side in this run", file=sys.stderr)
    elif not chart(png, rows, title):
        print("chart skipped: matplotlib is not installed (pip install '.[bench]')",
              file=sys.stderr)
        return
    else:
        print(f"chart: {png}")
        if save_chart:
            shutil.copyfile(png, REPO_ROOT / "bench" / "chart.png")
            print(f"chart copied to {REPO_ROOT / 'bench' / 'chart.png'}")
    curve = out / "names.png"
    load = [meta.get(k, [0.0])[0] for k in ("loadavg_before", "loadavg_after")]
    if curve_chart(curve, rows, f"job-name curve, ours (server {meta.get('server')}, "
                                f"{meta.get('rounds')} rounds, {meta.get('started', '')[:16]} "
                                f"UTC, load average {load[0]:.1f} -> {load[1]:.1f})"):
        print(f"job-name curve: {curve}")
        if save_chart:
            shutil.copyfile(curve, REPO_ROOT / "bench" / "names.png")
            print(f"curve copied to {REPO_ROOT / 'bench' / 'names.png'}")


def replot(out: Path, save_chart: bool) -> int:
    """Redraw the chart and table.md of an earlier run."""
    import json

    path = out / "results.json"
    if not path.is_file():
        print(f"no {path}: run the benchmark first", file=sys.stderr)
        return 2
    rows = load_rows(path)
    meta = json.loads(path.read_text())["meta"]
    (out / "table.md").write_text(markdown(rows) + "\n\n" + settings_text(meta) + "\n")
    print(table(rows))
    print("\n" + settings_text(meta))
    draw(out, rows, meta, save_chart)
    return 0


def _stop_on_term(signum: int, frame: object) -> None:
    """SIGTERM (a timeout, CI) unwinds like Ctrl-C: every server and worker the run
    started is stopped by its context manager instead of left running."""
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stop_on_term)
    sys.exit(main())
