"""Producer side of the benchmark, run as a subprocess configured like ``bench.app``.

``python -m bench.client enqueue --n N`` sends N jobs with ``apply_async`` (spread
round-robin over the app's job names, or ``--per-task`` counts) and prints
``{"n", "seconds", "cpu_seconds"}`` as JSON (with ``BENCH_MODE=dramatiq``: Dramatiq's
``noop.send()``). ``python -m bench.client profile --n N`` runs the same loop under
cProfile (CPU clock) and prints the hottest functions. ``python -m bench.client latency --n N``
sends N jobs one at a time to an idle worker, waiting for each to start, and prints
``{"latencies_ms": [...]}`` (enqueue call to job start, one clock).
``python -m bench.client fill-stamped --n N`` queues N jobs whose start is recorded as
a timestamp (the worker's drain rate, ``start_rate``), and ``python -m bench.client
load --n N --rate R`` sends N jobs at a steady R jobs/s without waiting for them, then
prints their enqueue-to-start latencies.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import sys
import time
from collections.abc import Sequence

from bench import app as bench_app

#: Jobs sent before the measured loop: connections, script loading, first declarations.
WARMUP = 200


def dramatiq_enqueue(n: int, warmup: int = 0) -> dict[str, float]:
    """Dramatiq's producer: ``send()`` of the no-op actor."""
    from bench import dramatiq_app

    for _ in range(warmup):
        dramatiq_app.noop.send()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        dramatiq_app.noop.send()
    return {"n": n, "seconds": time.perf_counter() - wall,
            "cpu_seconds": time.process_time() - cpu}


def enqueue(n: int, per_task: list[int] | None = None, warmup: int = 0) -> dict[str, float]:
    """Send jobs (after ``warmup`` unmeasured ones: connecting, loading scripts, first
    declarations); returns wall and CPU seconds of the ``apply_async`` loop."""
    if bench_app.MODE == "dramatiq":
        return dramatiq_enqueue(n, warmup)
    tasks = bench_app.TASKS
    if per_task is not None:
        order = [t for t, count in zip(tasks, per_task, strict=True) for _ in range(count)]
        random.Random(0).shuffle(order)
    else:
        order = [tasks[i % len(tasks)] for i in range(n)]
    queues = bench_app.QUEUE_NAMES
    for i in range(warmup):
        tasks[i % len(tasks)].apply_async()
    wall, cpu = time.perf_counter(), time.process_time()
    if queues:
        for i, task in enumerate(order):
            task.apply_async(queue=queues[i % len(queues)])
    else:
        for task in order:
            task.apply_async()
    return {"n": len(order), "seconds": time.perf_counter() - wall,
            "cpu_seconds": time.process_time() - cpu}


def profile(n: int, top: int) -> dict[str, object]:
    """cProfile (process CPU clock) of ``n`` ``apply_async`` of the first job name, after
    a warm-up; rows are (inclusive %, self %, calls per job, function)."""
    import cProfile
    import pstats

    task = bench_app.TASKS[0]
    for _ in range(WARMUP):
        task.apply_async()
    cpu = time.process_time()
    for _ in range(n):
        task.apply_async()
    plain_us = (time.process_time() - cpu) / n * 1e6
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    for _ in range(n):
        task.apply_async()
    prof.disable()
    stats = pstats.Stats(prof)
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = []
    for (path, _line, func), (_cc, calls, tt, ct, _callers) in \
            stats.stats.items():  # type: ignore[attr-defined]
        where = path.split("site-packages/")[-1]
        where = where if where.startswith(("celery", "kombu", "redis", "bench", "~")) else \
            "/".join(where.split("/")[-2:])
        rows.append((round(100 * ct / total, 1), round(100 * tt / total, 1),
                     round(calls / n, 1), f"{where}:{func}"))
    rows.sort(reverse=True)
    return {"n": n, "cpu_us_per_job": plain_us,
            "profiled_cpu_us_per_job": total / n * 1e6, "rows": rows[:top]}


def layers(batches: int, size: int) -> dict[str, dict[str, float]]:
    """CPU and wall µs per ``apply_async`` in this process, layer by layer: batches of
    ``size`` calls of each variant in turn, the minimum over ``batches`` (the least
    disturbed by other processes). Variants, each replacing one layer:

    - ``full``: nothing replaced;
    - ``celery_only``: Celery's ``send_task_message`` is a no-op: what Celery costs
      before the publish (routing, the message, signals, the result object);
    - ``no_transport``: the transport's ``Channel._put`` is a no-op: Celery and Kombu's
      producer, without the transport's write;
    - ``floor``: ``Channel._put`` is the message's JSON (Kombu's ``dumps``, as every
      Redis transport stores it) and one ``LPUSH`` of it on a kept connection, packed
      by hiredis: the least a transport's write can cost, the same on both sides;
    - ``direct_floor``: Kombu's ``Producer.publish`` is the body's serialization (Kombu's
      registry), a message dict, its JSON and that one ``LPUSH``: the least any publish
      path below Celery's ``send_task_message`` can cost, Kombu's producer included;
    - ours only, ``no_round_trip``: the script call on the kept connection returns a
      constant: everything but the round trip."""
    import hiredis
    import redis
    from kombu import messaging, serialization
    from kombu.utils.encoding import str_to_bytes
    from kombu.utils.json import dumps
    from kombu.utils.uuid import uuid

    task = bench_app.TASKS[0]
    amqp = bench_app.app.amqp
    for _ in range(WARMUP):
        task.apply_async()
    with bench_app.app.connection_for_write() as conn:
        channel_cls = type(conn.default_channel)
    sender, put, publish = amqp.send_task_message, channel_cls._put, messaging.Producer.publish
    line = redis.Redis.from_url(bench_app.counter_url(db=0)).connection_pool.get_connection()

    def no_publish(*args: object, **kwargs: object) -> None:
        return None

    def no_put(self: object, queue: str, message: object, **kwargs: object) -> None:
        return None

    def floor_put(self: object, queue: str, message: object, **kwargs: object) -> None:
        line.send_packed_command(
            [hiredis.pack_command(("LPUSH", "bench:floor", dumps(message)))],
            check_health=False)
        line.read_response()

    def direct_publish(self: object, body: object, routing_key: str | None = None,
                       headers: object = None, **kwargs: object) -> None:
        content_type, content_encoding, data = serialization.dumps(body, "json")
        message = {"body": base64.b64encode(str_to_bytes(data)).decode(),
                   "content-encoding": content_encoding, "content-type": content_type,
                   "headers": headers or {},
                   "properties": {"correlation_id": kwargs.get("correlation_id"),
                                  "delivery_info": {"exchange": "", "routing_key": routing_key},
                                  "body_encoding": "base64", "delivery_tag": uuid()}}
        floor_put(self, str(routing_key), message)

    variants: dict[str, dict[str, object]] = {
        "full": {}, "celery_only": {"send_task": no_publish}, "no_transport": {"put": no_put},
        "floor": {"put": floor_put}, "direct_floor": {"publish": direct_publish}}
    if bench_app.MODE == "ours":
        from celery_ext.producer import publish_line as producer

        def constant(self: object, commands: list[bytes]) -> list[int]:
            return [1] * len(commands)  # every script call "written", nothing sent

        variants["no_round_trip"] = {"send": constant}
        send = producer.PublishConnection.send
    cpu_best = dict.fromkeys(variants, float("inf"))
    wall_best = dict.fromkeys(variants, float("inf"))
    try:
        for _ in range(batches):
            for name, replace in variants.items():
                amqp.__dict__["send_task_message"] = replace.get("send_task", sender)
                channel_cls._put = replace.get("put", put)  # type: ignore[method-assign]
                messaging.Producer.publish = replace.get(  # type: ignore[method-assign]
                    "publish", publish)
                if bench_app.MODE == "ours":
                    producer.PublishConnection.send = replace.get(  # type: ignore
                        "send", send)
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(size):
                    task.apply_async()
                cpu_best[name] = min(cpu_best[name], (time.process_time() - cpu) / size * 1e6)
                wall_best[name] = min(wall_best[name], (time.perf_counter() - wall) / size * 1e6)
    finally:
        amqp.__dict__["send_task_message"] = sender
        channel_cls._put = put  # type: ignore[method-assign]
        messaging.Producer.publish = publish  # type: ignore[method-assign]
        if bench_app.MODE == "ours":
            producer.PublishConnection.send = send  # type: ignore[method-assign]
        line.disconnect()
    return {"cpu_us": cpu_best, "wall_us": wall_best}


def latency(n: int, warmup: int, gap: float) -> dict[str, list[float]]:
    """Enqueue-to-start latencies in ms of ``n`` jobs after ``warmup`` unmeasured ones."""
    task = bench_app.TASKS[0]
    rec = bench_app.counter()
    rec.delete(bench_app.LATENCY_KEY)
    out: list[float] = []
    for i in range(warmup + n):
        time.sleep(gap)  # let the worker go idle again (acks, wake-up listener)
        task.apply_async(args=(time.time(),))
        reply = rec.blpop([bench_app.LATENCY_KEY], timeout=30)
        if reply is None:
            raise RuntimeError(f"job {i} did not start within 30 s")
        if i >= warmup:
            out.append(float(reply[1]) * 1000.0)
    return {"latencies_ms": out}


def fill_stamped(n: int) -> dict[str, int]:
    """Queue ``n`` latency jobs stamped 0: each one records its start time itself, so
    ``start_rate`` can read the worker's drain rate from the starts."""
    task = bench_app.TASKS[0]
    bench_app.counter().delete(bench_app.LATENCY_KEY)
    for _ in range(n):
        task.apply_async(args=(0.0,))
    return {"n": n}


def load(n: int, rate: float, warmup: int) -> dict[str, list[float]]:
    """Send ``warmup`` then ``n`` jobs at a steady ``rate`` jobs/s (open loop: a send
    never waits for a job, only for its slot in the schedule); returns the measured
    jobs' enqueue-to-start latencies in ms, in start order."""
    task = bench_app.TASKS[0]
    rec = bench_app.counter()
    rec.delete(bench_app.LATENCY_KEY)
    gap = 1.0 / rate
    for part, count in (("warmup", warmup), ("measured", n)):
        t0 = time.perf_counter()
        for i in range(count):
            delay = t0 + i * gap - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            task.apply_async(args=(time.time(),))
        deadline = time.monotonic() + 30 + count / rate
        while rec.llen(bench_app.LATENCY_KEY) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{part}: only {rec.llen(bench_app.LATENCY_KEY)}/{count} "
                                   "jobs started within the deadline")
            time.sleep(0.01)
        values = [float(v) * 1000.0 for v in rec.lrange(bench_app.LATENCY_KEY, 0, -1)]
        rec.delete(bench_app.LATENCY_KEY)
    return {"latencies_ms": values}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.client")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_enq = sub.add_parser("enqueue")
    p_enq.add_argument("--n", type=int, required=True)
    p_enq.add_argument("--per-task", default="", help="comma-separated count per job name")
    p_enq.add_argument("--warmup", type=int, default=0, help="unmeasured jobs sent first")
    p_prof = sub.add_parser("profile")
    p_prof.add_argument("--n", type=int, required=True)
    p_prof.add_argument("--top", type=int, default=40)
    p_lay = sub.add_parser("layers")
    p_lay.add_argument("--batches", type=int, default=15)
    p_lay.add_argument("--size", type=int, default=500)
    p_lat = sub.add_parser("latency")
    p_lat.add_argument("--n", type=int, required=True)
    p_lat.add_argument("--warmup", type=int, default=20)
    p_lat.add_argument("--gap", type=float, default=0.005)
    p_fill = sub.add_parser("fill-stamped")
    p_fill.add_argument("--n", type=int, required=True)
    p_load = sub.add_parser("load")
    p_load.add_argument("--n", type=int, required=True)
    p_load.add_argument("--rate", type=float, required=True, help="jobs/s")
    p_load.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args(argv)
    if args.cmd == "enqueue":
        per = [int(c) for c in args.per_task.split(",")] if args.per_task else None
        result: object = enqueue(args.n, per, args.warmup)
    elif args.cmd == "profile":
        result = profile(args.n, args.top)
    elif args.cmd == "layers":
        result = layers(args.batches, args.size)
    elif args.cmd == "fill-stamped":
        result = fill_stamped(args.n)
    elif args.cmd == "load":
        result = load(args.n, args.rate, args.warmup)
    else:
        result = latency(args.n, args.warmup, args.gap)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
