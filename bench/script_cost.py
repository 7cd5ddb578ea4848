"""What one feature costs inside Redis per job: the enqueue, fetch and ack scripts alone.

No Celery and no worker: the same no-op jobs go through ``enqueue.lua`` (as the
producer calls it), ``fetch.lua`` (``--batch`` per call, one registered pool) and
``ack.lua`` (per batch), once per *variant*, alternating the order every round. The
server's own time per job (``INFO commandstats``: microseconds inside the scripts)
is the figure; the client's wall time is printed too but includes this process.

Variants (each against ``plain``, the same run without the feature):

* ``plain``      every job at the default priority, no fair key, no limits, index off
* ``priority``   jobs spread over the four default levels (0, 3, 6, 9 in turn)
* ``fair``       a fair key per job, cycling over ``--keys`` keys
* ``fair_rate``  ``fair``, and a per-key rate limit (``fair_rate_limit``) far above what
                 this loop reaches: every keyed fetch reads and moves its key's state
* ``rate_limit`` the queue rate-limited far above what this loop reaches (every fetch
                 checks and moves the limit's state, none is refused)
* ``index``      the job index on (``job_index_ttl`` 1 h): every move writes an entry
* ``revoked``    10,000 other task ids revoked (``{ns}:revoked``): every fetched job's id
                 is looked up there (store/revoked.py), none is dropped

    python -m bench.script_cost                              # every variant
    python -m bench.script_cost --variants plain,rate_limit --jobs 20000 --rounds 5

Least of the rounds and medians are both printed: on a shared machine a round is only
ever slowed down, so the least is the cost with the least interference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

VARIANTS = ("plain", "priority", "fair", "fair_rate", "rate_limit", "index", "revoked")
#: Other ids revoked in the ``revoked`` variant (far from ``revoked_max``, 50,000).
REVOKED_IDS = 10_000


def one_round(client: Any, variant: str, jobs: int, batch: int, keys: int) -> dict[str, float]:
    """Push, fetch and ack ``jobs`` jobs with ``variant``; microseconds per job."""
    from celery_ext.config import DEFAULT_PRIORITY_STEPS as STEPS
    from celery_ext.options.priority import level
    from celery_ext.options.rate_limits import interval_us
    from celery_ext.store.keys import Keys
    from celery_ext.store.scripts import Scripts, sha, source

    k, pool, queue = Keys("bench"), "bench:1:pool", "bench.job"
    scripts = Scripts(client)
    ttl = 3_600_000 if variant == "index" else 0
    client.flushall()
    client.zadd(k.pools, {pool: 1})
    if variant == "rate_limit":
        client.hset(k.rate_limits, queue, interval_us("1000000/s"))
    if variant == "fair_rate":  # (one µs between two jobs of a key: none is refused)
        client.hset(k.rate_limits, queue + "\n", interval_us("1000000/s"))
    if variant == "revoked":
        client.zadd(k.revoked, {f"other{i}": 2**50 for i in range(REVOKED_IDS)})
    client.script_load(source("enqueue"))  # EVALSHA in a pipeline needs it loaded
    with client.pipeline(transaction=False) as pipe:
        for i in range(jobs):
            props: dict[str, Any] = {"delivery_tag": f"t{i}", "correlation_id": f"id{i}"}
            prio = (0, 3, 6, 9)[i % 4] if variant == "priority" else 0
            props["priority"] = prio
            if variant in ("fair", "fair_rate"):
                props["fair_key"] = f"k{i % keys}"
            payload = json.dumps({"body": "", "headers": {"id": f"id{i}"}, "properties": props})
            pipe.evalsha(sha("enqueue"), 5, k.queue_level(queue, level(prio, STEPS)), k.ready,
                         k.queues, k.job_index, k.job_index_done,
                         payload, queue, k.wake_channel, 0, ttl)
        pipe.execute()
    client.config_resetstat()
    fetch_keys = k.fetch(pool, [queue] * batch, STEPS)
    fetch_args = [pool, "1" * batch, *[queue] * batch, 0, "1" if ttl else "0"]
    ack_keys = [k.inflight(pool), k.redelivery, k.running, k.limits, k.ready, k.job_index,
                k.job_index_done]
    # Every fetch first, then every ack: the server's time of the fetch calls alone is
    # read between the two.
    done, fetches, batches, wall = 0, 0, [], time.perf_counter()
    while done < jobs:
        got = scripts("fetch", fetch_keys, fetch_args)[1]
        if not got:
            raise RuntimeError(f"{variant}: fetch found nothing after {done} of {jobs} jobs")
        batches.append([job[1] for job in got])
        done, fetches = done + len(got), fetches + 1
    fetch_usec = client.info("commandstats")["cmdstat_evalsha"]["usec"]
    for tags in batches:
        scripts("ack", ack_keys, [k.wake_channel, ttl, k.cursor_prefix, pool, *tags])
    wall = time.perf_counter() - wall
    usec = client.info("commandstats")["cmdstat_evalsha"]["usec"]
    return {"server_us_per_job": usec / jobs, "wall_us_per_job": wall / jobs * 1e6,
            "server_us_per_fetch": fetch_usec / fetches}


def measure(variants: Sequence[str], jobs: int, rounds: int, batch: int,
            keys: int) -> dict[str, Any]:
    from bench.harness import median
    from bench.workloads import order
    from celery_ext.testing.server import RedisServer

    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    with RedisServer() as server:
        client = server.client()
        for rnd in range(rounds):
            for variant in order(rnd, tuple(variants)):
                runs[variant].append(one_round(client, variant, jobs, batch, keys))
    med = {v: median([r["server_us_per_job"] for r in rs]) for v, rs in runs.items()}
    least = {v: min(r["server_us_per_job"] for r in rs) for v, rs in runs.items()}
    fetch_med = {v: median([r["server_us_per_fetch"] for r in rs]) for v, rs in runs.items()}
    fetch_least = {v: min(r["server_us_per_fetch"] for r in rs) for v, rs in runs.items()}
    return {"jobs": jobs, "rounds": rounds, "batch": batch, "keys": keys, "runs": runs,
            "server_us_per_job_median": med, "server_us_per_job_least": least,
            "server_us_per_fetch_median": fetch_med, "server_us_per_fetch_least": fetch_least,
            "loadavg": os.getloadavg()}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.script_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="jobs per fetch")
    p.add_argument("--keys", type=int, default=100, help="fair keys (variants fair, fair_rate)")
    ns = p.parse_args(argv)
    variants = [v for v in ns.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown or "plain" not in variants:
        p.error(f"--variants: from {', '.join(VARIANTS)}, plain included")
    result = measure(variants, ns.jobs, ns.rounds, ns.batch, ns.keys)
    print(json.dumps({k: result[k] for k in (
        "server_us_per_job_median", "server_us_per_job_least", "server_us_per_fetch_median",
        "server_us_per_fetch_least")}))
    med, least = result["server_us_per_job_median"], result["server_us_per_job_least"]
    print(f"enqueue + fetch + ack, {ns.jobs} jobs, {ns.batch} per fetch, {ns.rounds} rounds, "
          f"load {result['loadavg'][0]:.2f}; Redis time per job (median / least of rounds):")
    for v in variants:
        print(f"  {v:10} {med[v]:6.1f} / {least[v]:6.1f} us"
              + ("" if v == "plain" else f"   x{med[v] / med['plain']:.2f} / "
                 f"x{least[v] / least['plain']:.2f} of plain"))
    fmed, fleast = result["server_us_per_fetch_median"], result["server_us_per_fetch_least"]
    print(f"Redis time per fetch call of {ns.batch} jobs (median / least of rounds):")
    for v in variants:
        print(f"  {v:10} {fmed[v]:6.1f} / {fleast[v]:6.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
