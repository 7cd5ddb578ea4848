"""``python -m bench.cluster``: drain of 30 job names on a local 3-master cluster vs one node.

Three servers' worth of processes on one machine, in the same run:

- **one node**: a fresh one-node server (AOF off), ``celery-ext://``;
- **cluster**: a fresh local Redis Cluster of ``--masters`` masters without replicas
  (``celery_ext.testing.server.ClusterGroup``, the slots split evenly), ``celery-ext://`` with the
  transport option ``cluster``;
- a third one-node server where every job counts its completion (``INCR``): a cluster has
  no db 2, so both sides count on the same separate server.

Each round fills the broker with ``--jobs`` no-op jobs spread evenly over 30 job names
(``bench.job_0000`` ... ``bench.job_0029``, each its own job queue) with the real producer
(``python -m bench.client enqueue``), then starts one worker and times it until every job
is counted. The two sides alternate their order every round; medians over ``--rounds``.
Both sides run ``install(app)`` with the same worker settings (pool, concurrency,
prefetch, acks), printed in the settings line.

During each cluster drain the harness also reads every master's ``INFO commandstats``
(commands executed, those run inside scripts included) and ``INFO cpu`` before and
after: each master's share of both against an even share (target: within +-15 % of
it), and how the 30 job queues landed on the masters (a queue is one hash slot, so the
load follows the slot split, not the queue count alone).

On a 2-core machine the masters, the worker and the counter server share two cores:
the absolute rates are bounded by that, not by the cluster. Output: a table on stdout,
``OUT/cluster.json`` and ``OUT/cluster.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

from redis.crc import key_slot

from bench import app as bench_app
from bench.harness import (
    REPO_ROOT,
    WORKER_FLAGS,
    Bench,
    BenchError,
    Proc,
    counts_delta,
    median,
    stop_all,
)
from celery_ext.config import DEFAULT_NAMESPACE
from celery_ext.store.keys import Keys
from celery_ext.testing.server import ClusterGroup, RedisServer

DEFAULT_OUT = REPO_ROOT / "bench" / "results"
#: The two sides, in the order of even rounds (odd rounds reverse it).
SIDES = ("one_node", "cluster")
#: Job names (one job queue each) the jobs are spread over.
NAMES = 30
#: How far a master's share may be from an even share, relative to it.
TOLERANCE = 0.15
#: Commands the harness itself sends to the masters (not the worker's load).
HARNESS_COMMANDS = ("info", "flushall", "cluster", "config")
#: redis-py's cluster pipeline asks its default node for the keys of every script call
#: it queues (``COMMAND GETKEYS``), one round trip each: counted apart from the spread,
#: which is about where the transport's own commands land.
GETKEYS = "command|getkeys"


@dataclass(frozen=True)
class Sizes:
    jobs: int = 20_000
    pool: str = "prefork"
    concurrency: int = 2
    acks: str = "late"
    masters: int = 3


FULL = Sizes()
QUICK = Sizes(jobs=2_000)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def settings_text(sizes: Sizes) -> str:
    """Every setting both sides run with, in words."""
    return (f"{sizes.jobs:,} pre-queued no-op jobs over {NAMES} job names (one job queue "
            f"each, round-robin), enqueued by the real producer (apply_async) before the "
            f"worker starts; one worker -P {sizes.pool} -c {sizes.concurrency}, acks "
            f"{sizes.acks}, prefetch multiplier 4 (Celery's default), no result backend, "
            f"no task events, {' '.join(WORKER_FLAGS)}; both sides celery-ext:// with "
            f"install(app); one node vs a {sizes.masters}-master cluster (no replicas, "
            f"slots split evenly, AOF off); completions counted by an INCR on a separate "
            f"one-node server; all on {os.cpu_count()} CPUs")


def slot_owners(cluster: ClusterGroup) -> dict[int, int]:
    """Hash slot -> port of the master serving it (from CLUSTER SLOTS)."""
    seed = cluster.master_servers()[0]
    with seed.client(socket_timeout=5.0) as c:
        ranges = c.execute_command("CLUSTER", "SLOTS")
    owners: dict[int, int] = {}
    for entry in ranges:
        first, last, master = int(entry[0]), int(entry[1]), entry[2]
        for slot in range(first, last + 1):
            owners[slot] = int(master[1])
    return owners


def placement(cluster: ClusterGroup) -> dict[str, Any]:
    """Where the 30 job queues' copies (and the namespace's home copy) live: a queue's
    copy is one hash slot, so it is on one master."""
    owners = slot_owners(cluster)
    keys = Keys(DEFAULT_NAMESPACE, cluster=True)
    per_master: dict[str, int] = {str(s.port): 0 for s in cluster.master_servers()}
    queues: dict[str, str] = {}
    for i in range(NAMES):
        name = bench_app.job_name(i)
        port = str(owners[key_slot(keys.of(name).queue(name).encode())])
        per_master[port] = per_master.get(port, 0) + 1
        queues[name] = port
    home = str(owners[key_slot(keys.home.pools.encode())])
    return {"queues_per_master": per_master, "home_copy_on": home, "queues": queues}


def master_stats(servers: list[RedisServer]) -> dict[str, dict[str, Any]]:
    """Per master (by port): commands executed by name and CPU seconds, now."""
    out: dict[str, dict[str, Any]] = {}
    for server in servers:
        with server.client(socket_timeout=5.0) as c:
            stats = c.info("commandstats")
            cpu = c.info("cpu")
        out[str(server.port)] = {
            "commands": {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()},
            "cpu": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
        }
    return out


def spread(before: dict[str, dict[str, Any]],
           after: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each master's commands and CPU during the drain, and its share of the total
    against an even one (``within``: no further from it than ``TOLERANCE``, relative)."""
    per: dict[str, dict[str, Any]] = {}
    for port, end in after.items():
        start = before[port]
        by_command = counts_delta(start["commands"], end["commands"], skip=HARNESS_COMMANDS)
        per[port] = {
            "commands": sum(n for name, n in by_command.items() if name != GETKEYS),
            "getkeys": by_command.get(GETKEYS, 0),
            "cpu_s": round(end["cpu"] - start["cpu"], 3),
            "by_command": dict(sorted(by_command.items(), key=lambda kv: -kv[1])),
        }
    even = 1 / len(per)
    for metric in ("commands", "cpu_s"):
        total = sum(p[metric] for p in per.values()) or 1
        for p in per.values():
            share = p[metric] / total
            p[f"{metric}_share"] = round(share, 4)
            p[f"{metric}_within"] = abs(share - even) <= TOLERANCE * even
    return per


def flush(servers: list[RedisServer]) -> None:
    for server in servers:
        with server.client(socket_timeout=30.0) as c:
            c.execute_command("FLUSHALL", "SYNC")


def drain_once(bench: Bench, side: str, url: str, brokers: list[RedisServer],
               sizes: Sizes, cluster: ClusterGroup | None) -> dict[str, Any]:
    """Flush, fill ``sizes.jobs`` jobs over the 30 names, start a worker, time the drain."""
    flush(brokers)
    bench.flush(bench_app.COUNTER_DB)
    extra: dict[str, Any] = {"broker_url": url, "names": NAMES,
                             "counter_url": bench.server.url(db=bench_app.COUNTER_DB),
                             "cluster": int(cluster is not None),
                             "acks_late": int(sizes.acks == "late")}
    t_fill = time.perf_counter()
    bench.run_client("ours", ["enqueue", "--n", str(sizes.jobs)],
                     timeout=120 + sizes.jobs * 0.05, **extra)
    fill_s = time.perf_counter() - t_fill
    stats0 = master_stats(brokers)
    worker: Proc = bench.worker("ours", sizes.pool, sizes.concurrency, **extra)
    worker.log_path = worker.log_path.with_name(worker.log_path.stem + f"-{side}.log")
    at_first: dict[str, Any] = {}
    t0 = time.perf_counter()
    worker.start()
    try:
        first, t1 = bench.wait_count(
            worker, sizes.jobs, timeout=120 + sizes.jobs / 20,
            on_first=lambda done: at_first.update(done=done, usage=worker.usage()))
        usage = worker.usage()
        stats1 = master_stats(brokers)
    finally:
        worker.stop()
    steady = max(1, sizes.jobs - at_first.get("done", 0))
    per = spread(stats0, stats1)
    return {
        "side": side,
        "jobs_per_s": round(sizes.jobs / (t1 - t0), 1),
        "steady_jobs_per_s": round(steady / max(t1 - first, 1e-6), 1),
        "startup_s": round(first - t0, 2),
        "fill_jobs_per_s": round(sizes.jobs / fill_s, 1),
        "redis_cpu_us_per_job": round(sum(p["cpu_s"] for p in per.values())
                                      / sizes.jobs * 1e6, 1),
        "commands_per_job": round(sum(p["commands"] for p in per.values()) / sizes.jobs, 2),
        "getkeys_per_job": round(sum(p["getkeys"] for p in per.values()) / sizes.jobs, 2),
        # From the first completion on (start-up excluded), as the drain workload does.
        "worker_cpu_us_per_job": round((usage["cpu_tree"] - at_first["usage"]["cpu_tree"])
                                       / steady * 1e6, 1),
        "worker_main_cpu_us_per_job": round((usage["cpu_main"] - at_first["usage"]["cpu_main"])
                                            / steady * 1e6, 1),
        "masters": per,  # one entry on one node
    }


def rebalance_queues(cluster: ClusterGroup) -> int:
    """Move whole (empty) hash slots of job queues from the masters holding more than
    an even share of the 30 job queues to those holding fewer, as an operator's
    rebalance would (``ClusterGroup.move_empty_slot``). Returns the slots moved."""
    keys = Keys(DEFAULT_NAMESPACE, cluster=True)
    masters = cluster.master_servers()
    by_port = {s.port: s for s in masters}
    owners = slot_owners(cluster)
    held: dict[int, list[int]] = {s.port: [] for s in masters}
    for i in range(NAMES):
        name = bench_app.job_name(i)
        slot = key_slot(keys.of(name).queue(name).encode())
        held[owners[slot]].append(slot)
    share = NAMES // len(masters)
    moved = 0
    for port in sorted(held, key=lambda p: -len(held[p])):
        while len(held[port]) > share + (1 if NAMES % len(masters) else 0):
            target = min(held, key=lambda p: len(held[p]))
            if len(held[target]) >= share:
                break
            slot = held[port].pop()
            cluster.move_empty_slot(slot, by_port[target])
            held[target].append(slot)
            moved += 1
    return moved


def run(sizes: Sizes, rounds: int, log_dir: Path, rebalance: bool = False) -> dict[str, Any]:
    """Every round of both sides; returns the runs and the placement of the queues."""
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    with ExitStack() as stack:
        bench = stack.enter_context(Bench.open(log_dir))
        one = stack.enter_context(RedisServer(appendonly=False))
        cluster = stack.enter_context(ClusterGroup(masters=sizes.masters))
        masters = cluster.master_servers()
        if rebalance:
            moved = rebalance_queues(cluster)
            log(f"rebalanced: moved {moved} job queue slot(s) so each master holds an even "
                "share of the job queues")
        where = placement(cluster)
        log(f"job queues per master (port: queues): {where['queues_per_master']}, "
            f"home copy on {where['home_copy_on']}")
        for rnd in range(rounds):
            for side in (SIDES if rnd % 2 == 0 else SIDES[::-1]):
                if side == "cluster":
                    res = drain_once(bench, side, cluster.url(), masters, sizes, cluster)
                else:
                    res = drain_once(bench, side, one.url(scheme="celery-ext"), [one], sizes,
                                     None)
                runs[side].append(res)
                log(f"  round {rnd + 1} {side}: {res['jobs_per_s']:.0f} jobs/s (steady "
                    f"{res['steady_jobs_per_s']:.0f}), Redis CPU {res['redis_cpu_us_per_job']:.0f}"
                    f" us/job, {res['commands_per_job']:.1f} commands/job")
        server = bench.server_version()
    return {"runs": runs, "placement": where, "server": server}


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Medians per side, the ratio cluster/one node, and per master medians of the
    shares with the ±15 % check."""
    runs = result["runs"]
    med = {side: {k: median([r[k] for r in runs[side]])
                  for k in ("jobs_per_s", "steady_jobs_per_s", "redis_cpu_us_per_job",
                            "commands_per_job", "getkeys_per_job", "worker_cpu_us_per_job",
                            "worker_main_cpu_us_per_job")} for side in SIDES}
    ratio = med["cluster"]["jobs_per_s"] / med["one_node"]["jobs_per_s"]
    ports = list(runs["cluster"][0]["masters"])
    queues = result["placement"]["queues_per_master"]
    even = 1 / len(ports)
    masters = {}
    for port in ports:
        m: dict[str, Any] = {"job_queues": queues.get(port, 0),
                             "queue_share": round(queues.get(port, 0) / NAMES, 4)}
        for metric in ("commands_share", "cpu_s_share"):
            share = median([r["masters"][port][metric] for r in runs["cluster"]])
            m[metric] = round(share, 4)
            m[metric.replace("share", "within")] = abs(share - even) <= TOLERANCE * even
        # Commands per job queue against the mean: how even the load is once the slot
        # split (how many queues a master holds) is taken out.
        if m["job_queues"]:
            m["commands_per_queue_vs_mean"] = round(m["commands_share"] / m["queue_share"], 3)
        m["getkeys"] = median([r["masters"][port]["getkeys"] for r in runs["cluster"]])
        masters[port] = m
    return {"median": med, "cluster_over_one_node": round(ratio, 3), "masters": masters}


def table(result: dict[str, Any], summ: dict[str, Any]) -> str:
    med = summ["median"]
    lines = ["| side | drain jobs/s (median) | steady jobs/s | worker CPU us/job (main) "
             "| Redis CPU us/job (all masters) | commands/job (+ COMMAND GETKEYS) | rounds |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for side in SIDES:
        rounds = ", ".join(f"{r['jobs_per_s']:.0f}" for r in result["runs"][side])
        lines.append(f"| {side.replace('_', ' ')} | {med[side]['jobs_per_s']:.0f} | "
                     f"{med[side]['steady_jobs_per_s']:.0f} | "
                     f"{med[side]['worker_cpu_us_per_job']:.0f} "
                     f"({med[side]['worker_main_cpu_us_per_job']:.0f}) | "
                     f"{med[side]['redis_cpu_us_per_job']:.0f} | "
                     f"{med[side]['commands_per_job']:.1f} "
                     f"(+{med[side]['getkeys_per_job']:.2f}) | {rounds} |")
    lines.append(f"\ncluster / one node: {summ['cluster_over_one_node']:.2f}")
    home = result["placement"]["home_copy_on"]
    lines += ["", f"spread over the masters during the cluster drains (even share "
                  f"{100 / len(summ['masters']):.1f} %, target within +-{TOLERANCE:.0%} of it; "
                  f"medians of the rounds):", "",
              "| master (port) | job queues (share) | commands executed | CPU "
              "| within +-15 % (commands / CPU) | commands per queue vs mean "
              "| COMMAND GETKEYS |", "|---|---:|---:|---:|---|---:|---:|"]
    for port, m in summ["masters"].items():
        mark = " (home copy)" if port == home else ""
        lines.append(f"| {port}{mark} | {m['job_queues']} of {NAMES} "
                     f"({m['queue_share']:.1%}) | "
                     f"{m['commands_share']:.1%} | {m['cpu_s_share']:.1%} | "
                     f"{'yes' if m['commands_within'] else 'no'} / "
                     f"{'yes' if m['cpu_s_within'] else 'no'} | "
                     f"{m.get('commands_per_queue_vs_mean', 0):.2f} | {m['getkeys']:,.0f} |")
    return "\n".join(lines)


CORES_NOTE = ("note: the masters, the worker (and its prefork children), the producer and "
              "the counter server all share this machine's {cpus} CPUs: the absolute rates "
              "are bounded by that, not by the cluster; a cluster's gain shows when its "
              "masters have cores (or hosts) of their own.")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=None, help="default 3; 1 with --quick")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK.jobs:,} jobs, 1 round (under two minutes)")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--pool", default=FULL.pool, choices=("prefork", "threads", "solo"))
    p.add_argument("--concurrency", type=int, default=None,
                   help="default 2 (prefork), 8 (threads), 1 (solo)")
    p.add_argument("--acks", default=FULL.acks, choices=("early", "late"))
    p.add_argument("--rebalance", action="store_true",
                   help="first move whole (empty) hash slots so each master holds an even "
                        "share of the 30 job queues, as an operator's rebalance would")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    if rounds < 1:
        print("--rounds must be >= 1", file=sys.stderr)
        return 2
    base = QUICK if args.quick else FULL
    conc = args.concurrency or {"prefork": 2, "threads": 8, "solo": 1}[args.pool]
    sizes = Sizes(jobs=args.jobs or base.jobs, pool=args.pool, concurrency=conc,
                  acks=args.acks, masters=base.masters)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "argv": list(argv if argv is not None else sys.argv[1:]), "rounds": rounds,
        "sizes": asdict(sizes), "cpus": os.cpu_count(), "rebalanced": args.rebalance,
        "settings": settings_text(sizes) + ("; job queue slots rebalanced over the masters "
                                            "(--rebalance)" if args.rebalance else ""),
        "loadavg_before": os.getloadavg(), "python": platform.python_version(),
        "versions": {p: version(p) for p in ("celery", "kombu", "redis", "celery-ext")},
    }
    log(f"settings: {meta['settings']}")
    t0 = time.monotonic()
    try:
        result = run(sizes, rounds, out / "logs-cluster", rebalance=args.rebalance)
    except BenchError as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        stop_all()
        print("interrupted", file=sys.stderr)
        return 130
    meta.update(seconds=round(time.monotonic() - t0, 1), loadavg_after=os.getloadavg(),
                server=result.pop("server"))
    summ = summary(result)
    text = table(result, summ)
    note = CORES_NOTE.format(cpus=os.cpu_count())
    settings_line = (f"settings (server {meta['server']}, {rounds} rounds): "
                     f"{meta['settings']}")
    (out / "cluster.json").write_text(json.dumps(
        {"meta": meta, "summary": summ, **result}, indent=1))
    (out / "cluster.md").write_text(f"{text}\n\n{settings_line}\n\n{note}\n")
    print(text)
    print("\n" + settings_line)
    print("\n" + note)
    print(f"\nresults: {out / 'cluster.json'} (cluster.md beside it); {meta['seconds']}s, "
          f"load {meta['loadavg_before'][0]:.2f} -> {meta['loadavg_after'][0]:.2f}")
    return 0


def _stop_on_term(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C: the servers and workers are stopped by their owners."""
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stop_on_term)
    sys.exit(main())
