"""``python -m bench.backlog --direct`` (``bench/fetch_loop.py``) runs end to end on tiny
sizes: the fetch and the ack called as a worker pool calls them, at every level, without a
worker, and the allocator of the server named with the figures. The figures themselves are
not timed tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import fetch_loop
from bench.harness import Bench
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
        # The rounds started once the keyspace was not being rehashed, and say how many
        # keys (publish markers, mostly) there were and how many expired meanwhile.
        assert point["rehashing"] is False and point["rehash_wait_s"] >= 0, point
        assert point["keys"] >= point["queued"] and point["expired_in_rounds"] >= 0, point
    assert data["settings"]["settle"] == "rehash"
    assert "rounds once the keyspace's rehash ended" in done.stdout


@pytest.mark.timeout(120)
def test_settle_waits_for_the_keyspaces_rehash_to_end(tmp_path: Path) -> None:
    """Keys with a TTL written past the keyspace table's size start a rehash of the keyspace
    and of its expiries, which every command pays for until it ends (bench/README.md, "The
    backlog at 1,000,000"); ``settle`` returns only once both have ended."""
    with Bench.open(tmp_path, debug=True) as bench:
        client = bench.client()
        written, seen = 0, False
        while not seen and written < 400_000:
            pipe = client.pipeline(transaction=False)
            for i in range(written, written + 5_000):
                pipe.set(f"marker:{i}", "1", px=600_000)
            pipe.execute()
            written += 5_000
            seen = fetch_loop.keyspace_rehashing(bench)
        assert seen, f"no rehash seen while writing {written:,} keys"
        assert fetch_loop.settle(bench, timeout=60) >= 0
        assert not fetch_loop.keyspace_rehashing(bench)
        text = client.execute_command("DEBUG", "HTSTATS", "0")
        assert b"rehashing target" not in text, text
