"""Result rows, the printed table, ``results.json`` and ``chart.png``."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import median


@dataclass
class Row:
    """One metric of one workload configuration, with every round's value per mode."""

    workload: str
    config: str
    metric: str
    higher_is_better: bool
    stock: list[float] = field(default_factory=list)
    ours: list[float] = field(default_factory=list)
    #: Dramatiq's value (its own Redis broker; enqueue and drain only).
    dramatiq: list[float] = field(default_factory=list)
    #: Fairness rows have no stock value: the ratio is against this (the weight share).
    expected: float | None = None
    #: Shown in the chart (secondary rows, e.g. CPU per job, are table/JSON only).
    primary: bool = True

    def add(self, mode: str, value: float) -> None:
        getattr(self, mode).append(float(value))

    @property
    def stock_median(self) -> float | None:
        return median(self.stock) if self.stock else None

    @property
    def ours_median(self) -> float | None:
        return median(self.ours) if self.ours else None

    @property
    def dramatiq_median(self) -> float | None:
        return median(self.dramatiq) if self.dramatiq else None

    @property
    def ratio(self) -> float | None:
        """ours / stock (or ours / expected), from the medians."""
        ours = self.ours_median
        base = self.stock_median if self.stock else self.expected
        if ours is None or base is None or base == 0:
            return None
        return ours / base

    @property
    def better(self) -> bool | None:
        """Whether ours beats (or matches) stock; None when there is nothing to compare."""
        r = self.ratio
        if r is None or not self.stock:
            return None
        return r >= 1.0 if self.higher_is_better else r <= 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload, "config": self.config, "metric": self.metric,
            "higher_is_better": self.higher_is_better, "primary": self.primary,
            "stock": {"median": self.stock_median, "runs": self.stock},
            "ours": {"median": self.ours_median, "runs": self.ours},
            "dramatiq": {"median": self.dramatiq_median, "runs": self.dramatiq},
            "expected": self.expected, "ratio": self.ratio,
        }


def _fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    a = abs(value)
    if a >= 1000:
        return f"{value:,.0f}"
    if a >= 100:
        return f"{value:.0f}"
    if a >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def table(rows: list[Row]) -> str:
    """A fixed-width table: medians per mode and ours/stock."""
    head = ("workload", "config", "metric", "stock", "ours", "ours/stock", "dramatiq")
    lines = []
    for row in rows:
        stock = _fmt(row.stock_median) if row.stock else (
            f"exp {_fmt(row.expected)}" if row.expected is not None else "n/a")
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}"
        if row.better is not None:
            ratio += "" if row.better else " (worse)"
        lines.append((row.workload, row.config, row.metric, stock, _fmt(row.ours_median), ratio,
                      _fmt(row.dramatiq_median)))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]

    def fmt_line(cells: tuple[str, ...]) -> str:
        left = [c.ljust(w) for c, w in zip(cells[:3], widths[:3], strict=True)]
        right = [c.rjust(w) for c, w in zip(cells[3:], widths[3:], strict=True)]
        return "  ".join(left + right).rstrip()

    out = [fmt_line(head), fmt_line(tuple("-" * w for w in widths))]
    out += [fmt_line(line) for line in lines]
    return "\n".join(out)


def markdown(rows: list[Row]) -> str:
    """The same table in Markdown, for bench/README.md."""
    out = ["| workload | config | metric | stock | ours | ours/stock | dramatiq |",
           "|---|---|---|---:|---:|---:|---:|"]
    for row in rows:
        stock = _fmt(row.stock_median) if row.stock else (
            f"expected {_fmt(row.expected)}" if row.expected is not None else "n/a")
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}"
        out.append(f"| {row.workload} | {row.config} | {row.metric} | {stock} | "
                   f"{_fmt(row.ours_median)} | {ratio} | {_fmt(row.dramatiq_median)} |")
    return "\n".join(out)


def load_rows(path: Path) -> list[Row]:
    """Rows back from a ``results.json`` (to redraw the chart without a new run)."""
    data = json.loads(path.read_text())
    return [Row(r["workload"], r["config"], r["metric"], r["higher_is_better"],
                stock=r["stock"]["runs"], ours=r["ours"]["runs"],
                dramatiq=r.get("dramatiq", {}).get("runs", []), expected=r["expected"],
                primary=r["primary"]) for r in data["rows"]]


def write_json(path: Path, meta: dict[str, Any], rows: list[Row],
               details: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "rows": [r.to_dict() for r in rows], "details": details}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)



def pyplot() -> Any | None:
    """matplotlib's pyplot on its file-only backend, or None without the bench extra:
    every chart is optional, the figures are in the printed table and the JSON."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt: Any, fig: Any, path: Path, dpi: int) -> None:
    """Write ``fig`` to ``path`` (its folder made) and free it: a bench run draws several."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


#: One panel of :func:`side_curves`: its y label, the value of a point, and whether the
#: value is drawn as a share of the side's first point.
Panel = tuple[str, Callable[[dict[str, Any]], float], bool]


def side_curves(path: Path, res: dict[str, Any], panels: Sequence[Panel], x: str,
                xlabel: str, title: str, *, log_x: bool = False,
                share_floor: float | None = None) -> bool:
    """A row of panels, one line per side (``res["sides"][mode]["points"]``) against the
    point's ``x`` field: the shape of the cost-curve commands' results. ``share_floor``
    draws the target line on the panels drawn as shares. False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 3.6))
    for ax, (ylabel, value, relative) in zip(axes, panels, strict=True):
        for mode, side in res["sides"].items():
            points = side["points"]
            ys = [value(p) for p in points]
            if relative:
                ys = [y / ys[0] for y in ys]
            ax.plot([p[x] for p in points], ys, marker="o", label=mode)
        if relative and share_floor is not None:
            ax.axhline(share_floor, color="grey", linestyle="--", linewidth=1)
        if log_x:
            ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    save_figure(plt, fig, path, dpi=80)
    return True

def chart(path: Path, rows: list[Row], title: str) -> bool:
    """Ratios ours/stock of the primary metrics (and fairness shares) as a PNG.

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    plt = pyplot()
    if plt is None:
        return False
    compared = [r for r in rows if r.primary and r.stock and r.ratio is not None]
    fair = [r for r in rows if r.workload == "fairness" and r.ours]
    ncols = 2 if fair else 1
    fig, axes = plt.subplots(1, ncols, figsize=(13 if fair else 9, 0.38 * len(compared) + 2),
                             gridspec_kw={"width_ratios": [3, 1]} if fair else None,
                             squeeze=False)
    ax = axes[0][0]
    labels, values, colors = [], [], []
    for row in reversed(compared):
        assert row.ratio is not None
        # Plot "how many times better": >1 is better whichever way the metric goes.
        gain = row.ratio if row.higher_is_better else 1.0 / row.ratio
        direction = "higher" if row.higher_is_better else "lower"
        labels.append(f"{row.workload}: {row.config} ({row.metric}, {direction} is better)")
        values.append(gain)
        colors.append("#2a9d8f" if gain >= 1.0 else "#e76f51")
    ax.barh(range(len(values)), values, color=colors)
    ax.set_yticks(range(len(values)), labels, fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    ticks = [t for t in (0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20)
             if min(values, default=1) / 1.5 <= t <= max(values, default=1) * 1.5]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("ours vs stock (x times better; >1 = ours better, log scale)")
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.2f}x", va="center", fontsize=7)
    ax.set_title(title, fontsize=10)
    if fair:
        fax = axes[0][1]
        xs = range(len(fair))
        fax.bar([x - 0.2 for x in xs], [r.expected or 0 for r in fair], width=0.4,
                label="weight share", color="#999999")
        fax.bar([x + 0.2 for x in xs], [r.ours_median or 0 for r in fair], width=0.4,
                label="measured", color="#2a9d8f")
        fax.set_xticks(list(xs), [r.config for r in fair], fontsize=8, rotation=20)
        fax.set_ylabel("% of fetches")
        fax.set_title("weighted fairness (ours)", fontsize=10)
        fax.legend(fontsize=8)
    save_figure(plt, fig, path, dpi=110)
    return True


def targets(rows: list[Row]) -> list[dict[str, Any]]:
    """The issue's targets, checked against this run's medians (missing rows skipped)."""
    out: list[dict[str, Any]] = []

    def check(name: str, value: float | None, ok: bool | None) -> None:
        if value is not None and ok is not None:
            out.append({"target": name, "value": round(value, 3), "met": ok})

    dramatiq = {r.metric: r.dramatiq_median for r in rows if r.workload == "drain"
                and r.metric.endswith("jobs/s") and r.dramatiq}
    for r in rows:
        if r.workload == "drain" and r.metric.endswith("jobs/s") and r.stock:
            # The issue's figure is the rate from the workers' start; the steady rate (from
            # the first completion on) is checked beside it, named as such.
            steady = ", startup left out" if r.metric != "jobs/s" else ""
            if not steady:
                check(f"drain {r.config}: ours/stock >= 1.0", r.ratio,
                      r.ratio is not None and r.ratio >= 1.0)
            theirs = dramatiq.get(r.metric)
            if theirs and r.ours_median is not None:
                # Issue 16: >= 1.0x Dramatiq with threads and solo, >= 0.7x with prefork.
                least = 0.7 if r.config.split(" -c ")[0].endswith("prefork") else 1.0
                v = r.ours_median / theirs
                check(f"drain {r.config}{steady}: ours/Dramatiq >= {least:g}", v, v >= least)
        elif r.workload == "enqueue" and r.metric == "jobs/s" and r.stock:
            check(f"enqueue {r.config}: ours/stock >= 2.0", r.ratio,
                  r.ratio is not None and r.ratio >= 2.0)
        elif r.workload == "latency" and r.metric in ("p50 ms", "p99 ms"):
            # Issue 16: p50 and p99 no worse than stock, at idle and under load.
            check(f"latency {r.config} {r.metric.split()[0]}: ours/stock <= 1.0", r.ratio,
                  r.ratio is not None and r.ratio <= 1)
        elif r.workload == "idle" and r.metric == "commands sent/s":
            sent = r.ours_median
            check("idle pool: ours <= 2 commands sent/s", sent, sent is not None and sent <= 2.0)
        elif r.workload == "memory" and r.metric == "Redis bytes/job":
            check("memory per queued job: ours/stock <= 1.2", r.ratio,
                  r.ratio is not None and r.ratio <= 1.2)
    from bench.names import curve_targets

    for name, value, met in curve_targets(rows):
        check(name, value, met)
    fair = [r for r in rows if r.workload == "fairness" and r.ours and r.expected]
    if fair:
        err = max(abs((r.ours_median or 0.0) - (r.expected or 0.0)) for r in fair)
        check("fairness: every share within 1 point of its weight share", err, err <= 1.0)
    return out


def targets_text(checks: list[dict[str, Any]]) -> str:
    return "\n".join(f"  [{'met' if c['met'] else 'MISSED'}] {c['target']}: {c['value']}"
                     for c in checks)
