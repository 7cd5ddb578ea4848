"""The benchmark harness runs end to end on tiny sizes and writes sane results.

Only the harness is checked here (every workload present, every number positive
and finite); the figures themselves are not timed tests.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers import run_bench

WORKLOADS = ("drain", "enqueue", "latency", "many_queues", "idle", "memory", "fairness")


@pytest.mark.timeout(330)
def test_bench_quick_writes_every_workload(tmp_path: Path) -> None:
    done = run_bench("bench", "--quick", "--rounds", "1", "--jobs", "150", "--pools", "solo-x2",
                     "--acks", "early", "--names", "1,10", "--one-name-queues", "10",
                     "--idle-seconds", "1", "--settle", "0.2", "--no-chart",
                     "--out", str(tmp_path),
                     timeout=300, what="the quick bench")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ours/stock" in done.stdout  # the table was printed
    # ...with every workload's settings: install or not, acks, backend, prefetch, sizes.
    for name in WORKLOADS:
        assert f"- {name}: " in done.stdout
    assert "result backend none or redis" in done.stdout and "prefetch" in done.stdout

    data = json.loads((tmp_path / "results.json").read_text())
    assert "error" not in data["meta"]
    rows = data["rows"]
    assert {r["workload"] for r in rows} == set(WORKLOADS)
    for row in rows:
        if row["config"].startswith("dramatiq"):  # Dramatiq's own drain rows
            sides: tuple[str, ...] = ("dramatiq",)
        elif row["workload"] == "fairness":
            sides = ("ours",)
        else:
            sides = ("stock", "ours")
        if row["workload"] == "enqueue":
            sides += ("dramatiq",)
        for side in sides:
            runs = row[side]["runs"]
            assert runs, (row["workload"], row["config"], row["metric"], side)
            for value in [*runs, row[side]["median"]]:
                assert math.isfinite(value) and value > 0, (row, side)
        if "stock" in sides or "ours" in sides:
            assert row["ratio"] is not None and math.isfinite(row["ratio"]) and row["ratio"] > 0
    # The drain ran two solo workers as one side (sized to match Dramatiq's processes).
    assert {r["config"] for r in rows if r["workload"] == "drain"} == {
        "2 workers x solo -c 1, acks early", "dramatiq --processes 2 --threads 8"}
    # Enqueue: with and without a result backend, with and without install(app).
    assert {r["config"] for r in rows if r["workload"] == "enqueue"} == {
        f"1 process, result backend {b}, ours {i}"
        for b in ("none", "redis") for i in ("install(app)", "drop-in")}
    # Fairness: shares of the first N fetches add up to 100 %.
    shares = [r["ours"]["median"] for r in rows if r["workload"] == "fairness"]
    assert abs(sum(shares) - 100.0) < 1e-6
    # many_queues: every configuration in every round, paired with the 1-name run, on the
    # pools --pools names; every metric of the curve (issue 36) paired too.
    many = data["details"]["many_queues"]["ours_vs_ours_1_name_paired"]
    pool = "2 workers x solo -c 1, acks early"
    assert set(many) == {f"1 job names, {pool}", f"10 job names, {pool}",
                         f"1 job name over 10 queues, {pool}"}
    assert all(len(v["rounds"]) == 1 and v["median"] > 0 for v in many.values())
    assert all(set(v["metrics"]) == {"jobs/s", "steady jobs/s", "start-up s",
                                     "Redis CPU us/job", "worker CPU us/job"}
               for v in many.values())
    assert (tmp_path / "table.md").is_file()


@pytest.mark.timeout(150)
def test_bench_layers_accounts_for_every_layer_of_every_side(tmp_path: Path) -> None:
    done = run_bench("bench.layers", "--rounds", "1", "--batches", "1", "--size", "30",
                     "--out", str(tmp_path), timeout=120, what="bench.layers")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stock/floor" in done.stdout and "load average" in done.stdout
    data = json.loads((tmp_path / "layers.json").read_text())
    assert set(data) == {"0", "1"}  # without and with a result backend
    for sides in data.values():
        assert set(sides) == {"stock", "ours, install(app)", "ours, drop-in"}
        for label, clocks in sides.items():
            layers = {"full", "no_transport", "floor", "direct_floor", "celery_only"}
            if label != "stock":
                layers.add("no_round_trip")
            for clock in ("cpu_us", "wall_us"):
                assert set(clocks[clock]) == layers, (label, clock)
                for values in clocks[clock].values():
                    assert len(values) == 1 and math.isfinite(values[0]) and values[0] > 0


@pytest.mark.timeout(330)
def test_bench_floor_drains_with_each_strategy_in_a_thread_pool(tmp_path: Path) -> None:
    # Thread pools take the strategies' hand-off path (a solo pool runs them inline), and
    # a strategy that breaks leaves jobs undone: the drain then times out with its log.
    done = run_bench("bench.floor", "--rounds", "1", "--jobs", "150", "--pool", "threads",
                     "--concurrency", "2", "--processes", "1", "--out", str(tmp_path),
                     timeout=300, what="bench.floor")
    assert done.returncode == 0, done.stderr[-3000:]
    medians = json.loads((tmp_path / "results.json").read_text())["medians"]
    assert set(medians) == {"stock", "stock at the floor", "ours", "ours at the floor",
                            "ours, what must be kept", "dramatiq"}
    for label, m in medians.items():
        assert math.isfinite(m["jobs_per_s"]) and m["jobs_per_s"] > 0, label


@pytest.mark.timeout(330)
def test_bench_pools_measures_every_level_idle_and_busy(tmp_path: Path) -> None:
    done = run_bench("bench.pools", "--levels", "1,2", "--jobs", "40", "--idle-seconds", "1",
                     "--monitor-seconds", "1", "--settle", "0.5", "--out", str(tmp_path),
                     timeout=300, what="bench.pools")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "idle commands/s sent per pool" in done.stdout and "load average" in done.stdout
    data = json.loads((tmp_path / "pools.json").read_text())
    assert set(data["sides"]) == {"stock", "ours"}
    for side in data["sides"].values():
        assert [p["pools"] for p in side["points"]] == [1, 2]
        for point in side["points"]:
            # Every pool answered inspect ping before anything was measured.
            assert point["ping"]["answered"] == point["pools"]
            idle, busy = point["idle"], point["busy"]
            for value in (point["rss_mib_per_pool"], idle["sent_per_s_per_pool"],
                          idle["executed_per_s_per_pool"], busy["jobs_per_s"],
                          busy["redis_cpu_us_per_job"], busy["executed_per_job"]):
                assert math.isfinite(value) and value > 0, point
            assert busy["jobs"] == 40


@pytest.mark.timeout(330)
def test_bench_backlog_measures_every_level_of_both_sides(tmp_path: Path) -> None:
    done = run_bench("bench.backlog", "--levels", "0,300", "--jobs", "50", "--out", str(tmp_path),
                     timeout=300, what="bench.backlog")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "drain at top / empty" in done.stdout and "load average" in done.stdout
    data = json.loads((tmp_path / "backlog.json").read_text())
    assert set(data["sides"]) == {"stock", "ours"}
    for side in data["sides"].values():
        empty, full = side["points"]
        assert (empty["level"], full["level"]) == (0, 300)
        # The fill reached the level: 300 jobs queued before that level's measurements,
        # each costing memory.
        assert full["queued"] == 300 and 0 < full["step_jobs"] <= 300
        assert full["used_memory"] > empty["used_memory"]
        assert full["step_bytes_per_job"] > 0
        for point in (empty, full):
            drain = point["drain"]
            for value in (point["enqueue_jobs_per_s"], drain["jobs_per_s"],
                          drain["redis_cpu_us_per_job"]):
                assert math.isfinite(value) and value > 0, point
            # The fetches were found in SLOWLOG (ours: fetch.lua by its SHA; stock: BRPOP).
            assert drain["fetch_calls"] > 0 and drain["fetch_us_per_call"] >= 0, point
        assert set(side["targets"]) == {"enqueue_vs_empty", "drain_vs_empty",
                                        "fetch_us_per_job_vs_empty", "memory_step_spread"}
