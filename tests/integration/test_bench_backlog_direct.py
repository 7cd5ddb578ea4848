"""``python -m bench.backlog --direct`` (``bench/fetch_loop.py``) runs end to end on tiny
sizes: the fetch and the ack called as a worker pool calls them, at every level, without a
worker, and the allocator of the server named with the figures. The figures themselves are
not timed tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers import run_bench


@pytest.mark.timeout(200)
def test_direct_measures_the_fetch_and_ack_at_every_level(tmp_path: Path) -> None:
    done = run_bench("bench.backlog", "--direct", "--levels", "0,300", "--rounds", "2",
                     "--round-jobs", "60", "--out", str(tmp_path), timeout=180,
                     what="bench.backlog --direct")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "At the most queued against the empty server" in done.stdout
    data = json.loads((tmp_path / "backlog_direct.json").read_text())
    # The server is named with its allocator (libc or jemalloc), which the figures depend on.
    allocator = data["settings"]["server"].rsplit(", ", 1)[-1]
    assert allocator == "libc" or allocator.startswith("jemalloc"), data["settings"]
    empty, full = data["points"]
    assert (empty["level"], full["level"]) == (0, 300)
    # Each level is filled to its backlog plus the same jobs for the rounds on top, and
    # every queued job has its index entry.
    assert full["queued"] - empty["queued"] == 300
    assert full["index_entries"] >= full["queued"]
    for point in (empty, full):
        for name in ("fetch", "ack", "control", "redis_cpu", "rpop", "hsetnx", "hset"):
            assert math.isfinite(point[name]) and point[name] > 0, (name, point)
        assert len(point["fetch_rounds"]) == 2
