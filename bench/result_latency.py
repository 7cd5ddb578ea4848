"""``python -m bench.result_latency``: the get() round trip, Celery's Redis result backend
against ours, interleaved.

Two fresh servers: one for the brokers (``celery-ext://`` for both sides, db 0 for
Celery's side and db 3 for ours, so each worker sees only its own jobs), one for the
result backends (Celery's ``redis://`` db 1, ours ``celery-ext://`` db 2). One prefork
worker ``-c 2`` per side runs the whole time; this process sends
``noop.delay().get()`` one after another, in short rounds (``--per-round``) that alternate
between the sides (``--rounds`` each, the first side of each pair alternating too), so
a change in the machine's load hits both sides alike.

For each get() it takes, on the monotonic clock the workers share with it (Linux's
``CLOCK_MONOTONIC``): the send (``delay()``), the client's own read before waiting
(``on_wait_for_pending``), the job's start, the backend's store in the worker (its read
of the old meta, the write and the wake-up publish), the moment the client handled the
ready meta (and whether a wake-up message or a read brought it) and the return of
get(); a negative ``wake`` means the client had the meta before the worker had read the
reply to its store. Per round, ``INFO commandstats`` of the results server says which
commands one get() cost there. Prints p50/p99 per side, the ratio of medians and the
median of each round pair's ratio (load shifts between pairs cancel), the medians of the
parts for all gets and for the slowest 5 %, the client's and the worker's CPU and the
commands per get() and the load average; writes ``OUT/latency.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness import REPO_ROOT, median, percentile
from bench.result_backend import start_worker, stop_worker
from celery_ext.testing.server import RedisServer

DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "result_latency"
#: side -> (result backend scheme, results db, broker db)
SIDES = {"celery": ("redis", 1, 0), "ours": ("celery-ext", 2, 3)}
PARTS = ("send", "client_read", "to_start", "run", "store", "wake", "return")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.result_latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20, help="rounds per side")
    p.add_argument("--per-round", type=int, default=50, help="gets per round")
    p.add_argument("--quick", action="store_true", help="4 rounds of 20: a smoke run")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.per_round = 4, 20
    return args


class Side:
    """One side: its app in this process, its worker and where the worker's stamps go."""

    def __init__(self, name: str, brokers: RedisServer, results: RedisServer,
                 out: Path) -> None:
        from bench.result_latency_app import make_app

        scheme, db, broker_db = SIDES[name]
        self.name = name
        self.broker = brokers.url(scheme="celery-ext", db=broker_db)
        self.backend = results.url(scheme=scheme, db=db)
        self.stamps_path = out / f"stamps-{name}.txt"
        self.stamps_path.unlink(missing_ok=True)
        self.app = make_app(self.broker, self.backend)
        self.task = self.app.tasks["bench.result_latency_app.noop"]
        self.client: dict[str, dict[str, Any]] = {}
        self._instrument()

    def _instrument(self) -> None:
        """Stamp the consumer's read before waiting and the first ready meta it handles."""
        consumer = self.app.backend.result_consumer
        client = self.client
        before_wait = consumer.on_wait_for_pending
        on_state_change = consumer.on_state_change

        def on_wait_for_pending(result: Any, *args: Any, **kwargs: Any) -> Any:
            out = before_wait(result, *args, **kwargs)
            client.setdefault(result.id, {})["read_done"] = time.monotonic()
            return out

        def state_change(meta: dict[str, Any], message: Any) -> Any:
            row = client.setdefault(str(meta.get("task_id")), {})
            if meta.get("status") == "SUCCESS" and "ready" not in row:
                row["ready"] = time.monotonic()
                row["by"] = "read" if message is None else "message"
            return on_state_change(meta, message)

        consumer.on_wait_for_pending = on_wait_for_pending
        consumer.on_state_change = state_change

    def env(self) -> dict[str, str]:
        return {**{k: v for k, v in os.environ.items() if not k.startswith("CELERY_EXT_")},
                "BENCH_BROKER_URL": self.broker, "BENCH_RESULT_BACKEND": self.backend,
                "BENCH_STAMPS": str(self.stamps_path),
                "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}

    def get_once(self) -> float:
        t0 = time.monotonic()
        res = self.task.delay()
        t1 = time.monotonic()
        res.get(timeout=30)
        t2 = time.monotonic()
        self.client.setdefault(res.id, {}).update(t0=t0, sent=t1, done=t2)
        return (t2 - t0) * 1000

    def parts(self) -> tuple[dict[str, list[float]], dict[str, list[float]], Counter[str]]:
        """Each measured get() cut into its parts (ms), the same for the slowest 5 % of
        the gets alone, and what brought the ready meta."""
        worker: dict[str, list[float]] = {}
        for line in self.stamps_path.read_text().splitlines():
            task_id, *stamps = line.split()
            worker[task_id] = [float(s) for s in stamps]
        out: dict[str, list[float]] = {p: [] for p in PARTS}
        tail: dict[str, list[float]] = {p: [] for p in PARTS}
        by: Counter[str] = Counter()
        measured = {t: c for t, c in self.client.items() if "t0" in c and "ready" in c}
        slowest = sorted(measured, key=lambda t: measured[t]["t0"] - measured[t]["done"])
        slow = set(slowest[:max(1, len(slowest) // 20)])
        for task_id, c in measured.items():
            w = worker.get(task_id)
            if w is None:
                continue
            started, store_began, store_ended, _ = w
            by[c["by"]] += 1
            for part, (a, b) in {
                    "send": (c["t0"], c["sent"]), "client_read": (c["sent"], c["read_done"]),
                    "to_start": (c["sent"], started), "run": (started, store_began),
                    "store": (store_began, store_ended), "wake": (store_ended, c["ready"]),
                    "return": (c["ready"], c["done"])}.items():
                out[part].append((b - a) * 1000)
                if task_id in slow:
                    tail[part].append((b - a) * 1000)
        return out, tail, by


def tree_cpu(pid: int) -> float:
    """CPU seconds of a worker and its prefork children."""
    import psutil

    try:
        main = psutil.Process(pid)
        procs = [main, *main.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            cpu = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += cpu.user + cpu.system
    return total


def commandstats(client: Any) -> Counter[str]:
    return Counter({k.removeprefix("cmdstat_"): int(v["calls"])
                    for k, v in client.info("commandstats").items()})


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    with RedisServer() as brokers, RedisServer() as results:
        sides = {name: Side(name, brokers, results, args.out) for name in SIDES}
        workers = {name: start_worker(f"latency-{name}", s.env(), args.out,
                                      "bench.result_latency_app") for name, s in sides.items()}
        times: dict[str, list[float]] = {name: [] for name in sides}
        commands: dict[str, Counter[str]] = {name: Counter() for name in sides}
        cpu = dict.fromkeys(sides, 0.0)
        worker_cpu = dict.fromkeys(sides, 0.0)
        control = results.client()
        try:
            for side in sides.values():  # each worker is up, each client subscribed
                for _ in range(3):
                    side.get_once()
                side.client.clear()
            order = list(sides)
            for i in range(args.rounds):
                for name in order if i % 2 == 0 else order[::-1]:
                    before = commandstats(control)
                    cpu_before = time.process_time()
                    worker_before = tree_cpu(workers[name].pid)
                    times[name] += [sides[name].get_once() for _ in range(args.per_round)]
                    cpu[name] += time.process_time() - cpu_before
                    worker_cpu[name] += tree_cpu(workers[name].pid) - worker_before
                    commands[name] += commandstats(control) - before
        finally:
            for worker in workers.values():
                stop_worker(worker)
    load_after = os.getloadavg()
    n = args.rounds * args.per_round
    rows: dict[str, Any] = {}
    for name, side in sides.items():
        parts, tail, by = side.parts()
        commands[name].pop("info", None)
        rows[name] = {"p50_ms": median(times[name]), "p99_ms": percentile(times[name], 99),
                      "parts_p50_ms": {p: median(v) for p, v in parts.items()},
                      "slowest_5pc_parts_p50_ms": {p: median(v) for p, v in tail.items()},
                      "ready_by": dict(by), "client_cpu_us": cpu[name] / n * 1e6,
                      "worker_cpu_us": worker_cpu[name] / n * 1e6,
                      "commands_per_get": {k: v / n for k, v in commands[name].items()}}
    ratio = rows["ours"]["p50_ms"] / rows["celery"]["p50_ms"]
    per = args.per_round  # each round against its pair's other round: load shifts cancel
    pairs = [median(times["ours"][i:i + per]) / median(times["celery"][i:i + per])
             for i in range(0, n, per)]
    paired = median(pairs)
    print(f"{args.rounds} rounds x {args.per_round} gets per side, interleaved")
    print(f"{'':24}{'celery':>10}{'ours':>10}")
    for key in ("p50_ms", "p99_ms"):
        print(f"{'get() ' + key:24}" + "".join(f"{rows[s][key]:>10.2f}" for s in SIDES))
    for part in PARTS:
        print(f"{'  ' + part + ' p50 ms':24}"
              + "".join(f"{rows[s]['parts_p50_ms'][part]:>10.2f}" for s in SIDES))
    print("the slowest 5 % of the gets of each side, their parts:")
    for part in PARTS:
        print(f"{'  ' + part + ' p50 ms':24}"
              + "".join(f"{rows[s]['slowest_5pc_parts_p50_ms'][part]:>10.2f}" for s in SIDES))
    print(f"{'client CPU per get (us)':24}"
          + "".join(f"{rows[s]['client_cpu_us']:>10.0f}" for s in SIDES))
    print(f"{'worker CPU per get (us)':24}"
          + "".join(f"{rows[s]['worker_cpu_us']:>10.0f}" for s in SIDES))
    print(f"ratio of medians ours/celery: {ratio:.2f}; median of the {len(pairs)} rounds' "
          f"ratios: {paired:.2f} (ours faster in {sum(r < 1 for r in pairs)})")
    for s in SIDES:
        spent = ", ".join(f"{k} {v:.2f}" for k, v in sorted(rows[s]["commands_per_get"].items()))
        print(f"{s}: ready meta by {rows[s]['ready_by']}; commands per get on the results "
              f"server: {spent}")
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    (args.out / "latency.json").write_text(json.dumps(
        {"args": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows,
         "ratio_p50": ratio, "paired_ratios": pairs, "load_before": load_before,
         "load_after": load_after}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
