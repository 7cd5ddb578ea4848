"""``python -m bench.backlog --direct``: the fetch's cost inside Redis at each backlog level,
without a worker (issue 36, "Where the backlog's fetch cost goes").

A worker's drain measures the fetch on a server that also serves the worker's other
calls, on a machine whose two cores the worker shares with it; SLOWLOG's wall clock then
counts the server's waits for a core. Here one client calls the scripts themselves, in
rounds, and ``INFO commandstats`` gives the time inside Redis per job:

- ``fetch.lua`` as a worker pool calls it (``transport/fetch.py``'s ``fetch_call``, 12
  candidates of the one job queue per call, every job tracked) by its SHA (``evalsha``),
  and ``ack.lua`` for the jobs fetched sent as ``EVAL`` of its source, so that its time
  counts apart from the fetch's (``eval``);
- each command the scripts call (``rpop``, ``hsetnx``, ``hset`` ...), per job;
- a control script that pops 12 jobs with ``RPOP`` and returns them in a table (none of
  the fetch's records): what any script reading the same list pays on this server;
- Redis CPU per job (``used_cpu_user`` + ``used_cpu_sys``) over fetch and ack.

Each figure is the median of ``--rounds`` rounds of ``--round-jobs`` jobs. The backlog is
filled as ``bench.backlog`` fills ours (``apply_many``): to its level plus the jobs the
rounds and the control take, so every level's rounds run on the same jobs on top of it.

The rounds start once the keyspace is not being rehashed (``--settle rehash``, the
default). A fill writes one publish marker key per job, so the keyspace grows with the
fill and doubles its table each time it passes a power of two; while the server moves the
entries to the new table (incrementally, a step in every key lookup), every command pays
for it, ``RPOP`` included: at 1,000,000 queued the fill passes 2^20 keys just before the
rounds, and rounds run inside that window cost 3-6x what they cost a few seconds later
(bench/README.md, "The backlog at 1,000,000: the keyspace's rehash"). A worker meets that
window once per doubling of the keys; the fetch's cost at a backlog is what the rounds
measure after it. ``--settle none`` measures at once, as before.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench import backlog
from bench.harness import Bench, BenchError

#: Candidates per fetch call: about what a ``-P threads -c 8`` worker asks for
#: (``bench.backlog``'s drains fetched 12-13 jobs per call).
CANDIDATES = 12
#: The commands each level reports per job, the fetch's and the ack's.
COMMANDS = ("rpop", "hsetnx", "hset", "hget", "hincrby", "hdel", "zadd", "zrange", "llen",
            "time")
#: The control: pop up to CANDIDATES jobs and return them, nothing recorded.
#: Longest wait for the keyspace's rehash to end before a level's rounds (it ends in
#: seconds to tens of seconds at 1,000,000 keys; the server's cron moves 1 ms of it
#: each 100 ms when no command does).
SETTLE_TIMEOUT = 600.0
CONTROL = """local out = {}
for i = 1, tonumber(ARGV[1]) do
  local p = redis.call('RPOP', KEYS[1])
  if not p then break end
  out[#out + 1] = {'q', 't' .. i, 'q' .. '\\n' .. p}
end
return out"""


def keyspace_rehashing(bench: Bench) -> bool:
    """Whether db 0's keyspace or its table of expiries is being rehashed: ``DEBUG
    HTSTATS`` lists a second table ("Hash table 1", the rehash's target) while it is."""
    out = bench.client().execute_command("DEBUG", "HTSTATS", "0")
    text = out.decode() if isinstance(out, bytes) else str(out)
    return "Hash table 1" in text


def settle(bench: Bench, timeout: float = SETTLE_TIMEOUT) -> float:
    """Wait until the keyspace is not being rehashed; the seconds waited."""
    t0 = time.monotonic()
    while keyspace_rehashing(bench):
        if time.monotonic() - t0 > timeout:
            raise BenchError(f"the keyspace was still being rehashed after {timeout:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - t0


def _keyspace(bench: Bench) -> tuple[int, int]:
    """(keys, keys with a TTL) in db 0."""
    db = bench.info("keyspace").get("db0", {})
    return int(db.get("keys", 0)), int(db.get("expires", 0))


def _usec(bench: Bench) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): int(v["usec"])
            for k, v in bench.info("commandstats").items()}


def _median(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r.get(k, 0.0) for r in rounds), 2) for k in rounds[0]}


class Loop:
    """One pool's fetch and ack calls on ``bench``'s server, as a worker sends them."""

    def __init__(self, bench: Bench) -> None:
        from celery_ext.config import Settings
        from celery_ext.store.job_index import index_keys, index_ttl_ms
        from celery_ext.store.keys import Keys
        from celery_ext.store.scripts import Scripts, sha, source
        from celery_ext.worker.heartbeater import Heartbeater

        self.bench = bench
        self.client = bench.client()
        self.settings = Settings.load()  # (CELERY_EXT_JOB_INDEX=0: the index off, as in a worker)
        self.keys = Keys.for_settings(self.settings)
        Scripts(self.client).load_all()
        pool = Heartbeater(self.client, self.settings, "bench:1:fetch-loop")
        pool.register()
        self.pool_id = pool.pool_id
        self.fetch_sha, self.ack_source = sha("fetch"), source("ack")
        k = self.keys
        self.ack_keys = [k.inflight(self.pool_id), k.redelivery, k.running, k.limits, k.ready,
                         *index_keys(k)]
        self.ack_args = [k.wake_channel, index_ttl_ms(self.settings), k.cursor_prefix,
                         self.pool_id]
        self.control_sha = str(self.client.script_load(CONTROL))

    def fetch_round(self, jobs: int) -> dict[str, float]:
        """Fetch and ack ``jobs`` jobs; µs inside Redis per job."""
        from celery_ext.transport.fetch import fetch_call

        queue = self.keys.queue(backlog.JOB)
        self.client.config_resetstat()
        cpu, done = self.bench.redis_cpu(), 0
        while done < jobs:
            keys, args = fetch_call(self.keys, self.settings, self.pool_id,
                                    [backlog.JOB] * CANDIDATES, "1" * CANDIDATES)
            reply: Any = self.client.evalsha(self.fetch_sha, len(keys), *keys, *args)
            tags = [job[1] for job in reply[1]]
            if not tags:
                raise RuntimeError(f"the backlog ran out: {queue} is empty")
            self.client.eval(self.ack_source, len(self.ack_keys), *self.ack_keys,
                             *self.ack_args, *tags)
            done += len(tags)
        cpu = self.bench.redis_cpu() - cpu
        usec = _usec(self.bench)
        out = {"fetch": usec.get("evalsha", 0) / done, "ack": usec.get("eval", 0) / done,
               "redis_cpu": cpu / done * 1e6}
        out.update({name: usec.get(name, 0) / done for name in COMMANDS})
        return out

    def control_round(self, jobs: int) -> dict[str, float]:
        """The control script over ``jobs`` jobs; µs inside Redis per job."""
        queue = self.keys.queue(backlog.JOB)
        self.client.config_resetstat()
        done = 0
        while done < jobs:
            got = len(self.client.evalsha(self.control_sha, 1, queue, CANDIDATES))
            if not got:
                raise RuntimeError(f"the backlog ran out: {queue} is empty")
            done += got
        usec = _usec(self.bench)
        return {"control": usec.get("evalsha", 0) / done,
                "control_rpop": usec.get("rpop", 0) / done}


def run(bench: Bench, levels: Sequence[int], rounds: int, jobs: int,
        wait_rehash: bool = True) -> list[dict[str, Any]]:
    """Every level on ``bench``'s fresh server: the median of ``rounds`` rounds of ``jobs``
    jobs fetched and acked, then as many of the control's; with ``wait_rehash``, once
    the keyspace's rehash has ended (``bench`` opened with ``debug``)."""
    url = bench.server.url(scheme="celery-ext", db=0)
    app = backlog.make_app("ours", url)
    client = bench.client()
    bench.flushall()
    loop = Loop(bench)
    # Per round: up to CANDIDATES - 1 jobs past ``jobs``; twice: the fetch's and the control's.
    per_level = 2 * rounds * (jobs + CANDIDATES)
    points: list[dict[str, Any]] = []
    try:
        for level in levels:
            have = backlog.queued(client, "ours")
            backlog.fill_ours(app, level + per_level - have)
            waited = settle(bench) if wait_rehash else 0.0
            keys, expires = _keyspace(bench)
            point: dict[str, Any] = {
                "level": level, "queued": backlog.queued(client, "ours"),
                "keys": keys, "rehash_wait_s": round(waited, 1),
                "rehashing": keyspace_rehashing(bench) if wait_rehash else None,
                "index_entries": int(client.hlen(loop.keys.job_index)),
                "used_memory": backlog.used_memory(bench)}
            fetches = [loop.fetch_round(jobs) for _ in range(rounds)]
            controls = [loop.control_round(jobs) for _ in range(rounds)]
            # Keys with a TTL that went during the rounds: publish markers expiring.
            point["expired_in_rounds"] = expires - _keyspace(bench)[1]
            point.update(_median(fetches))
            point.update(_median(controls))
            point["fetch_rounds"] = [round(r["fetch"], 1) for r in fetches]
            point["loadavg"] = [round(x, 2) for x in os.getloadavg()]
            backlog.log(f"  at {level:,} queued ({keys:,} keys, rehash waited {waited:.1f} s): "
                        f"fetch.lua {point['fetch']:.1f} us/job, ack.lua {point['ack']:.1f}, "
                        f"control {point['control']:.1f}; load {point['loadavg'][0]}")
            points.append(point)
    finally:
        app.close()
    return points


def table(points: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    cols = ("fetch", "ack", "control", "redis_cpu", *COMMANDS)
    lines = ["| queued | keys | rehash wait s | expired in rounds | "
             + " | ".join(f"{c} µs/job" for c in cols) + " | load (1 min) |",
             "|---|" + "---:|" * (len(cols) + 4)]
    for p in points:
        lines.append(f"| {p['level']:,} | {p['keys']:,} | {p['rehash_wait_s']} | "
                     f"{p['expired_in_rounds']:,} | "
                     + " | ".join(f"{p[c]:.2f}" for c in cols) + f" | {p['loadavg'][0]} |")
    base, top = points[0], points[-1]
    lines += ["", "At the most queued against the empty server: " + ", ".join(
        f"{c} {top[c] / base[c]:.2f}x" for c in ("fetch", "ack", "control", "redis_cpu")
        if base[c])]
    lines += ["", f"Settings: levels {', '.join(f'{n:,}' for n in settings['levels'])} queued; "
              f"median of {settings['rounds']} rounds of {settings['round_jobs']:,} jobs "
              f"fetched ({CANDIDATES} candidates per fetch.lua call) and acked, then as many "
              f"of the control's; one client, no worker; "
              + ("rounds once the keyspace's rehash ended" if settings.get("settle") == "rehash"
                 else "rounds right after the fill (no wait for the keyspace's rehash)")
              + f"; server {settings['server']}, AOF "
              f"off. Commit {settings['commit']}, {settings['started']}; load average "
              f"before {settings['load_before']}, after {settings['load_after']}."]
    return "\n".join(lines)
