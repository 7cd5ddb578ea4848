"""Where a queued job's bytes go in Redis, stock Celery-on-Redis beside ours (issue 36).

One server of its own; per mode, ``--jobs`` no-op jobs are sent by ``bench.client
enqueue`` (``apply_async``, ``install(app)`` for ours, no result backend) into an
empty database, and the database's keys are grouped by what they hold: the job
queue's list (the messages), the job index, the per-job publish markers (the
exactly-once enqueue), the rest. Per group it prints ``MEMORY USAGE`` per job; per mode
``used_memory``'s growth per job (which also counts what ``MEMORY USAGE`` leaves out:
the keyspace's and the expiry table's entries of per-job keys), and one message's
length.

    python -m bench.memory_split                    # 20,000 jobs
    python -m bench.memory_split --jobs 5000
    python -m bench.memory_split --marker-ttl 3600  # every publish marker still there

Prints a table and writes ``<out>/memory_split.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from celery_ext.store.keys import Keys
from celery_ext.testing.server import RedisServer

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
MODES = {"stock": "redis", "ours": "celery-ext"}


def group_of(key: str, kind: str, keys: Keys) -> str:
    """What a key holds, as this report names it."""
    if kind == "list":
        return "messages (job queue lists)"
    if key == keys.job_index:
        return "job index (hash)"
    if kind == "string" and key.startswith(keys.prefix):
        return "per-job strings (publish markers)"
    return f"other ({kind})"


def measure(server: RedisServer, mode: str, jobs: int,
            marker_ttl: float | None = None) -> dict[str, Any]:
    client = server.client()
    client.flushall()
    used0 = int(client.info("memory")["used_memory"])
    env = dict(os.environ, BENCH_MODE=mode, BENCH_BROKER_URL=server.url(scheme=MODES[mode]))
    if marker_ttl is not None:  # (a slow enqueue outlives the default TTL's first markers)
        env["CELERY_EXT_PUBLISH_IDEMPOTENCY_TTL"] = str(marker_ttl)
    subprocess.run([sys.executable, "-m", "bench.client", "enqueue", "--n", str(jobs),
                    "--warmup", "0"], env=env, cwd=REPO, check=True, capture_output=True)
    used1 = int(client.info("memory")["used_memory"])
    keys = Keys("celery_ext")
    usage: Counter[str] = Counter()
    count: Counter[str] = Counter()
    message = b""
    for raw in client.scan_iter(count=1000):
        key = raw.decode()
        kind = client.type(raw).decode()
        group = group_of(key, kind, keys)
        usage[group] += int(client.memory_usage(raw, samples=0) or 0)
        count[group] += 1
        if kind == "list" and not message:
            message = client.lindex(raw, 0) or b""
    client.close()
    return {"used_memory_per_job": (used1 - used0) / jobs, "message_bytes": len(message),
            "groups": {g: {"keys": count[g], "bytes_per_job": usage[g] / jobs}
                       for g in sorted(usage, key=usage.__getitem__, reverse=True)}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memory_split",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--marker-ttl", type=float, default=None,
                        help="publish_idempotency_ttl (s) for ours: long enough that every "
                             "publish marker is still there when memory is read")
    args = parser.parse_args(argv)
    results = {}
    with RedisServer() as server:
        for mode in MODES:
            results[mode] = r = measure(server, mode, args.jobs, args.marker_ttl)
            print(f"{mode}: used_memory +{r['used_memory_per_job']:.0f} B/job, "
                  f"one message {r['message_bytes']} B")
            for group, g in r["groups"].items():
                print(f"    {group:38} {g['keys']:>7,} keys {g['bytes_per_job']:8.1f} B/job")
    ratio = results["ours"]["used_memory_per_job"] / results["stock"]["used_memory_per_job"]
    print(f"ours / stock: {ratio:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_split.json").write_text(json.dumps(
        {"jobs": args.jobs, "marker_ttl": args.marker_ttl, "results": results,
         "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
