"""``python -m bench.cluster`` runs end to end on tiny sizes and writes sane results.

Only the harness is checked (both sides drained every job, every master reported, the
30 job queues all placed, the settings and the 2-core note printed); the figures
themselves are not timed tests.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers import run_bench


@pytest.mark.timeout(200)
def test_bench_cluster_quick_writes_both_sides_and_the_spread(tmp_path: Path) -> None:
    done = run_bench("bench.cluster", "--quick", "--jobs", "90", "--pool", "solo",
                     "--out", str(tmp_path), timeout=170, what="the quick cluster bench")
    out = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cluster / one node:" in out
    assert "-P solo -c 1, acks late, prefetch multiplier 4" in out  # the settings line
    assert "install(app)" in out and "share this machine's" in out  # the cores note

    data = json.loads((tmp_path / "cluster.json").read_text())
    for side in ("one_node", "cluster"):
        (run,) = data["runs"][side]
        for key in ("jobs_per_s", "redis_cpu_us_per_job", "commands_per_job"):
            assert math.isfinite(run[key]) and run[key] > 0, (side, key, run)
    masters = data["runs"]["cluster"][0]["masters"]
    assert len(masters) == 3
    assert all(m["commands"] > 0 for m in masters.values())
    assert sum(m["commands_share"] for m in masters.values()) == pytest.approx(1.0, abs=1e-3)
    placed = data["placement"]["queues_per_master"]
    assert set(placed) == set(masters) and sum(placed.values()) == 30
    assert data["placement"]["home_copy_on"] in masters
    assert (tmp_path / "cluster.md").is_file()
