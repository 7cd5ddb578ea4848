"""Cost of the job index (job_index.py): memory per entry and script time per job.

No worker: the scripts alone, on a server of their own, A/B per round (index on, index
off), so the figure is the index's part without the noise of a worker on a shared
machine. Each round pushes ``--jobs`` real Celery payloads (one sent through the
plugin's producer, copied with fresh ids) with ``enqueue``, fetches them ``--batch``
per call into a registered pool with ``fetch`` and acks them with ``ack`` one per call,
as a pool does. It reports, per job:

- the server's time inside the three scripts (``INFO commandstats``, µs),
- the client's wall time for the three calls (µs),
- Redis memory the index holds (``used_memory`` after the enqueues minus the same
  with the index off; and again after the acks: the finished entries and their
  expiry zset), in bytes,
- the enqueue script with the task id read from the payload (as shipped) against
  the task id passed as an argument (``--variant argv``, a copy of the script made
  here): which of the two is cheaper for the producer.

    python -m bench.job_index                       # 20,000 jobs, 5 rounds, batch 8
    python -m bench.job_index --jobs 5000 --rounds 3

Prints each round and the medians, and writes ``<out>/job_index.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
#: The configurations of a round: label -> (index on, task id passed as ARGV).
CONFIGS = {"off": (False, False), "on": (True, False), "on_argv": (True, True)}


def template_payload(url: str, client: Any) -> tuple[str, str, str]:
    """A payload as the plugin's producer writes it, its task id and delivery tag."""
    import celery

    import celery_ext  # noqa: F401  (registers the URL scheme)

    app = celery.Celery("bench-index", broker=url, set_as_current=False)
    task_id = str(uuid.uuid4())
    app.send_task("bench.job", args=(1,), task_id=task_id, queue="bench.template")
    app.close()
    text = client.rpop("{celery_ext}:queue:bench.template").decode()
    tag = json.loads(text)["properties"]["delivery_tag"]
    return text, task_id, tag


def run_round(client: Any, scripts: Any, argv_enqueue: Any, template: tuple[str, str, str],
              jobs: int, batch: int, indexed: bool, by_argv: bool) -> dict[str, float]:
    from celery_ext.store.keys import Keys

    k = Keys("bench")
    payload, task_id, tag = template
    pool, queue = "bench:1:pool", "bench.job"
    ttl = 3_600_000 if indexed else 0
    client.flushall()
    client.zadd(k.pools, {pool: int(time.time() * 1000)})
    client.config_resetstat()
    base = client.info("memory")["used_memory"]
    qkeys = [k.queue(queue), k.ready, k.queues, k.job_index, k.job_index_done]
    wall = time.perf_counter()
    for _ in range(jobs):
        new_id = str(uuid.uuid4())
        one = payload.replace(task_id, new_id).replace(tag, str(uuid.uuid4()))
        if by_argv:
            argv_enqueue(keys=qkeys, args=[one, queue, k.wake_channel, 0, ttl, "", new_id])
        else:
            scripts("enqueue", qkeys, [one, queue, k.wake_channel, 0, ttl])
    enqueue_wall = time.perf_counter() - wall
    queued_mem = client.info("memory")["used_memory"] - base
    enqueue_us = client.info("commandstats")["cmdstat_evalsha"]["usec"]
    fetch_keys = k.fetch(pool, [queue] * batch, (0,))
    fetch_args = [pool, "1" * batch, *[queue] * batch, 0, int(indexed)]
    ack_keys = [k.inflight(pool), k.redelivery, k.running, k.limits, k.ready,
                k.job_index, k.job_index_done]
    fetched = 0
    wall = time.perf_counter()
    while fetched < jobs:
        _, got, *_ = scripts("fetch", fetch_keys, fetch_args)
        if not got:
            break
        fetched += len(got)
        for job in got:
            scripts("ack", ack_keys, [k.wake_channel, ttl, k.cursor_prefix, pool, job[1]])
    work_wall = time.perf_counter() - wall
    total_us = client.info("commandstats")["cmdstat_evalsha"]["usec"]
    done_mem = client.info("memory")["used_memory"] - base
    return {"server_us_per_job": total_us / jobs, "enqueue_server_us": enqueue_us / jobs,
            "fetch_ack_server_us": (total_us - enqueue_us) / jobs,
            "wall_us_per_job": (enqueue_wall + work_wall) / jobs * 1e6,
            "queued_bytes_per_job": queued_mem / jobs, "done_bytes_per_job": done_mem / jobs,
            "fetched": fetched}


def measure(jobs: int, rounds: int, batch: int) -> dict[str, Any]:
    from bench.harness import median
    from celery_ext.store import scripts as _scripts
    from celery_ext.store.scripts import Scripts
    from celery_ext.testing.server import RedisServer

    # The ARGV variant: the same script with the task id taken from ARGV[7].
    argv_source = _scripts.source("enqueue").replace(
        "jix_set(KEYS[4], jix_task_id(payload)", "jix_set(KEYS[4], ARGV[7]")
    out: dict[str, list[dict[str, float]]] = {label: [] for label in CONFIGS}
    with RedisServer(appendonly=False) as server:
        client = server.client()
        scripts = Scripts(client)
        argv_enqueue = client.register_script(argv_source)
        template = template_payload(server.url(scheme="celery-ext"), client)
        for rnd in range(rounds):
            labels = list(CONFIGS) if rnd % 2 == 0 else list(CONFIGS)[::-1]
            for label in labels:
                indexed, by_argv = CONFIGS[label]
                res = run_round(client, scripts, argv_enqueue, template, jobs, batch,
                                indexed, by_argv)
                out[label].append(res)
                print(f"round {rnd + 1} {label}: server {res['server_us_per_job']:.1f} us/job "
                      f"(enqueue {res['enqueue_server_us']:.1f}, fetch+ack "
                      f"{res['fetch_ack_server_us']:.1f}), wall {res['wall_us_per_job']:.0f} "
                      f"us/job, memory queued {res['queued_bytes_per_job']:.0f} B/job, "
                      f"done {res['done_bytes_per_job']:.0f} B/job", file=sys.stderr)
    med = {label: {m: median([r[m] for r in runs]) for m in runs[0]}
           for label, runs in out.items()}
    return {
        "jobs": jobs, "rounds": rounds, "batch": batch, "medians": med,
        "index_bytes_per_queued_job": med["on"]["queued_bytes_per_job"]
        - med["off"]["queued_bytes_per_job"],
        "index_bytes_per_done_job": med["on"]["done_bytes_per_job"]
        - med["off"]["done_bytes_per_job"],
        "server_us_added_per_job": med["on"]["server_us_per_job"]
        - med["off"]["server_us_per_job"],
        "enqueue_parse_minus_argv_us": med["on"]["enqueue_server_us"]
        - med["on_argv"]["enqueue_server_us"],
        "loadavg": os.getloadavg(), "runs": out,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.job_index", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ns = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    result = measure(ns.jobs, ns.rounds, ns.batch)
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "job_index.json").write_text(json.dumps(result, indent=2) + "\n")
    med = result["medians"]
    print(f"{ns.jobs} jobs, {ns.rounds} rounds, fetch batch {ns.batch}: enqueue+fetch+ack "
          f"server time {med['off']['server_us_per_job']:.1f} us/job without the index, "
          f"{med['on']['server_us_per_job']:.1f} with (+{result['server_us_added_per_job']:.1f}); "
          f"wall {med['off']['wall_us_per_job']:.0f} -> {med['on']['wall_us_per_job']:.0f} "
          f"us/job; index memory {result['index_bytes_per_queued_job']:.0f} B per queued job, "
          f"{result['index_bytes_per_done_job']:.0f} B per finished job; task id from the "
          f"payload minus from ARGV in enqueue: {result['enqueue_parse_minus_argv_us']:+.2f} "
          f"us/job; load {result['loadavg'][0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
