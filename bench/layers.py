"""Where ``apply_async`` spends its time, layer by layer, stock and ours in one run.

``python -m bench.layers [--rounds 3] [--batches 15] [--size 500]`` runs
``python -m bench.client layers`` (see its docstring) for stock Kombu ``redis://``, ours
with ``install(app)`` and ours drop-in, without and with a Redis result backend, the
order of the sides turning every round. Each run alternates batches of ``--size`` calls
of every variant (the whole call; Celery alone; Celery and Kombu's producer without the
transport's write; the cheapest write any transport could make, the message's JSON and
one ``LPUSH``; the cheapest publish path below Celery's ``send_task_message``) and keeps
each variant's least CPU and wall time over ``--batches``: the least disturbed by other
processes. A row's figure is the median of those over the rounds.

The table answers one question: how fast could ``apply_async`` be with a given layer
made free? ``stock / x`` is stock's whole call divided by ``x``, a rate ratio as the
enqueue workload reports it: ``full`` is ours as it is, ``floor`` ours with the
cheapest transport write, ``direct floor`` ours with the cheapest publish path (Kombu's
producer included), ``Celery only`` ours with a publish that costs nothing, not even
its round trip.

    python -m bench.layers                 # 3 rounds (~6 min on 2 cores)
    python -m bench.layers --quick         # 1 round of 5 batches of 300 (~1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness import REPO_ROOT, Bench
from bench.workloads import log

OUT = REPO_ROOT / "bench" / "results" / "layers"
#: (label, mode, extra environment) of each side.
SIDES: tuple[tuple[str, str, dict[str, int]], ...] = (
    ("stock", "stock", {}),
    ("ours, install(app)", "ours", {"install": 1}),
    ("ours, drop-in", "ours", {"install": 0}),
)
#: The variants of ``bench.client layers``, in the order of the table's columns.
LAYERS = ("full", "no_transport", "floor", "direct_floor", "celery_only", "no_round_trip")


def run(rounds: int, batches: int, size: int, log_dir: Path) -> dict[str, Any]:
    """{backend: {side: {"cpu_us"|"wall_us": {layer: [one figure per round]}}}}."""
    out: dict[str, Any] = {}
    with Bench.open(log_dir) as bench:
        for rnd in range(rounds):
            sides = SIDES if rnd % 2 == 0 else tuple(reversed(SIDES))
            for backend in (0, 1):
                for label, mode, extra in sides:
                    bench.flushall()
                    log(f"[layers] round {rnd + 1}, backend {backend}, {label}")
                    res = bench.run_client(
                        mode, ["layers", "--batches", str(batches), "--size", str(size)],
                        timeout=60 + batches * size * 0.02, backend=backend, acks_late=1,
                        **extra)
                    side = out.setdefault(str(backend), {}).setdefault(label, {})
                    for clock, figures in res.items():
                        for layer, value in figures.items():
                            side.setdefault(clock, {}).setdefault(layer, []).append(value)
    return out


def table(results: dict[str, Any]) -> str:
    """The wall-time table with its ratios, then the CPU figures."""
    lines = ["wall us per apply_async (median over rounds of the least batch); "
             "stock / x = stock's full call over x, as a rate ratio",
             f"{'backend':<8} {'side':<20} " + " ".join(f"{layer:>13}" for layer in LAYERS)
             + "   stock/full  stock/floor  stock/direct  stock/celery"]
    for backend, sides in results.items():
        stock_full = statistics.median(sides["stock"]["wall_us"]["full"])
        for label, clocks in sides.items():
            wall = {layer: statistics.median(v) for layer, v in clocks["wall_us"].items()}
            cells = " ".join(f"{wall[layer]:>13.0f}" if layer in wall else f"{'-':>13}"
                             for layer in LAYERS)
            ratios = "  ".join(f"{stock_full / wall[layer]:>11.2f}" for layer in
                               ("full", "floor", "direct_floor", "celery_only"))
            lines.append(f"{'redis' if backend == '1' else 'none':<8} {label:<20} {cells}"
                         f"  {ratios}")
    lines.append("")
    lines.append("CPU us per apply_async (same method)")
    for backend, sides in results.items():
        for label, clocks in sides.items():
            cpu = {layer: statistics.median(v) for layer, v in clocks["cpu_us"].items()}
            lines.append(f"{'redis' if backend == '1' else 'none':<8} {label:<20} " + " ".join(
                f"{cpu[layer]:>13.0f}" if layer in cpu else f"{'-':>13}" for layer in LAYERS))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.layers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=15)
    p.add_argument("--size", type=int, default=500)
    p.add_argument("--quick", action="store_true", help="1 round of 5 batches of 300")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.batches, args.size = 1, 5, 300
    load_before = os.getloadavg()[0]
    results = run(args.rounds, args.batches, args.size, args.out / "logs")
    text = table(results)
    settings = (f"settings: {args.rounds} rounds x {args.batches} batches of {args.size} "
                "apply_async of one no-op task (ignore_result=True), task_acks_late=True, "
                "no worker; result backend none or redis:// (db 1, same server); load "
                f"average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "layers.json").write_text(json.dumps(results, indent=1))
    (args.out / "layers.txt").write_text(text + "\n\n" + settings + "\n")
    print(text)
    print()
    print(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
