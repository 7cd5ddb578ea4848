"""``python -m tests.faults``: every fault scenario, stock vs ours, side by side.

Prints a table, writes ``results.json`` and ``table.md`` to ``--out``; logs and
each run's append-only record stay there too. ``--scale-soak`` runs the scale soak
(tests/faults/scale.py) at its own sizes, unless given, and also writes ``scale.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

from tests.faults.harness import MODES, Options, Result, Run
from tests.faults.scale import SCALE_DEFAULTS, SCALE_SCENARIOS, ScaleRun, scale_table
from tests.faults.scenarios import SCENARIOS

#: Scenarios only named runs include: the long soak and the scale soak.
NOT_BY_DEFAULT = ("soak", *SCALE_SCENARIOS)

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def _fmt_recovery(r: Result) -> str:
    if not r.faults:
        return "-"
    text = f"{r.recovery_median:.1f}/{r.recovery_max:.1f}" if r.recovery_max is not None else ""
    if r.unrecovered_faults:
        text += f"{' +' if text else ''}{r.unrecovered_faults} never"
    if r.resumed_max is not None or r.unresumed_faults:
        answered = f"{r.resumed_max:.1f}" if r.resumed_max is not None else "-"
        never = f" +{r.unresumed_faults} never" if r.unresumed_faults else ""
        text += f"{'; ' if text else ''}answered again {answered}{never}"
    return text or "-"


def table(results: list[Result]) -> str:
    """Markdown table: one row per scenario, stock and ours side by side."""
    by = {(r.scenario, r.mode): r for r in results}
    names = list(dict.fromkeys(r.scenario for r in results))
    head = ("| scenario | faults | stock lost | stock dup | stock publish-retry dup "
            "| stock recovery s (med/max) | ours lost | ours dup (in flight) "
            "| ours publish-retry dup | ours recovery s (med/max) | refused (ours) "
            "| pools reaped (ours) |")
    rows = [head, "|" + "---|" * 12]
    for name in names:
        s, o = by.get((name, "stock")), by.get((name, "ours"))
        cells = [name, str(len((o or s).faults)) if (o or s) else "-"]  # type: ignore[union-attr]
        for r, ours in ((s, False), (o, True)):
            if r is None:
                cells += ["-", "-", "-", "-"]
                continue
            if r.not_run:
                cells += [f"not run: {r.not_run}", "-", "-", "-"]
                continue
            dead = f" (+{r.dead} dead)" if r.dead else ""
            cells.append(f"{r.lost}/{r.accepted}{dead}")
            cells.append(f"{r.duplicates} ({r.in_flight_at_faults})" if ours else str(r.duplicates))
            cells.append(str(r.publish_retry_duplicates))
            cells.append(_fmt_recovery(r))
        cells.append(str(o.refused) if o else "-")
        cells.append(str(o.pools_reaped) if o else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    defaults = Options()
    parser = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__)
    parser.add_argument("--scenarios", default=None,
                        help=f"comma-separated, from: {', '.join(SCENARIOS)} (default: all "
                             "but soak and scale_soak_*; 'soak' runs every fault kind in one "
                             "long run)")
    parser.add_argument("--scale-soak", action="store_true",
                        help="run " + " and ".join(SCALE_SCENARIOS) + " with "
                             + ", ".join(f"--{k.replace('_', '-')} {v}"
                                         for k, v in SCALE_DEFAULTS.items())
                             + " unless given (4 runs: 1,000,000 jobs, 300 kills)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    for f in fields(Options):
        value = getattr(defaults, f.name)
        if isinstance(value, tuple):
            continue
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(value), default=None,
                            help=f"default {SCALE_DEFAULTS.get(f.name, value)} with "
                                 f"--scale-soak, else {value}" if f.name in SCALE_DEFAULTS
                            else f"default {value}")
    args = parser.parse_args(argv)
    preset = SCALE_DEFAULTS if args.scale_soak else {}
    opts = Options(**{f.name: preset.get(f.name, getattr(defaults, f.name))
                      if getattr(args, f.name, None) is None else getattr(args, f.name)
                      for f in fields(Options) if hasattr(args, f.name)})
    if args.scenarios is None:
        args.scenarios = ",".join(SCALE_SCENARIOS) if args.scale_soak else ",".join(
            n for n in SCENARIOS if n not in NOT_BY_DEFAULT)
    scenarios = [s for s in args.scenarios.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    for name in scenarios:
        if name not in SCENARIOS:
            parser.error(f"unknown scenario {name!r}")
    args.out = args.out.resolve()  # the servers run in their own working directory
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    t0 = time.monotonic()
    for i, name in enumerate(scenarios):
        # Alternate which transport goes first, as the benchmark does.
        for mode in (modes if i % 2 == 0 else modes[::-1]):
            print(f"{name} / {mode}: {SCENARIOS[name].title}", flush=True)
            runner = ScaleRun if name in SCALE_SCENARIOS else Run
            result = runner(SCENARIOS[name], mode, opts, args.out).run()
            results.append(result)
            if result.not_run:
                print(f"  not run: {result.not_run}", flush=True)
                continue
            print(f"  lost {result.lost}/{result.accepted}, dead {result.dead} "
                  f"{result.dead_reasons or ''}, duplicates {result.duplicates}, "
                  f"in flight at faults {result.in_flight_at_faults}, refused {result.refused}, "
                  f"recovery {_fmt_recovery(result)}, publish-retry duplicates "
                  f"{result.publish_retry_duplicates}, unexplained duplicates "
                  f"{result.unexplained_duplicates}, "
                  f"pools reaped {result.pools_reaped}, crashed pools {result.crashed_pools}, "
                  f"consumer reconnects {result.reconnects}, server connections per fault "
                  f"{[f.connections for f in result.faults]}, answered again after "
                  f"{[f.resumed for f in result.faults if f.resumed is not None]} s, "
                  f"{result.seconds} s"
                  + "".join(f"\n  note: {n}" for n in result.notes)
                  + "".join(f"\n  failover: master with {f['job_queues']} job queues killed, "
                            f"replica promoted after {f['promoted_s']} s, the first job of its "
                            f"queues fetched after the kill done after {f['flowing_s']} s"
                            for f in result.failovers), flush=True)
    text = table(results)
    print()
    print(text)
    (args.out / "table.md").write_text(text + "\n")
    scaled = [r for r in results if r.scenario in SCALE_SCENARIOS and not r.not_run]
    if scaled:
        text = scale_table(scaled)
        print()
        print(text)
        (args.out / "scale.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps(
        {"options": asdict(opts), "minutes": round((time.monotonic() - t0) / 60, 1),
         "results": [r.as_dict() for r in results]}, indent=1))
    broken = [r for r in results if r.mode == "ours" and (
        (SCENARIOS[r.scenario].promise_no_loss and r.lost) or r.unexplained_duplicates)]
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
