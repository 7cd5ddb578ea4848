"""The drain profile's account by layer (``bench.profile``): pure functions over py-spy's
raw stacks, as a solo worker of ours and a prefork pool of stock write them."""

from __future__ import annotations

from pathlib import Path

from bench.profile import EVENT_LOOP, layer_of, parse_stacks, report_stacks

LOOP = ["Hub.create_loop (kombu/asynchronous/hub.py:372)",
        "MultiChannelPoller.on_readable (celery_ext/transport/channel.py:159)"]
DELIVER = [*LOOP, "Channel._brpop_read (celery_ext/transport/channel.py:742)",
           "Transport._deliver (kombu/transport/virtual/base.py:1016)",
           "Consumer._receive_callback (kombu/messaging.py:858)",
           "default.<locals>.task_message_handler (celery/worker/strategy.py:132)",
           "create_request_cls.<locals>.Request.execute_using_pool (celery/worker/request.py:1003)",
           "apply_target (celery/concurrency/base.py:22)",
           "build_tracer.<locals>.trace_task (celery/app/trace.py:454)"]


def test_each_stack_counts_in_its_innermost_layer() -> None:
    job = [*DELIVER, "_make_job.<locals>.job (bench/app.py:128)",
           "Redis.execute_command (redis/client.py:866)"]
    assert layer_of(job).startswith("job body")
    # An ack made inside the tracer (a solo pool's on_success) is an ack, not the tracer.
    ack = [*DELIVER,
           "create_request_cls.<locals>.Request.on_success (celery/worker/request.py:1026)",
           "Request.acknowledge (celery/worker/request.py:901)",
           "WorkerPool.ack (celery_ext/worker/worker_pool.py:310)"]
    assert layer_of(ack) == "acks"
    # A signal's dispatch and its receivers are their own layer, inside the tracer or not.
    assert layer_of([*DELIVER, "Signal.send (celery/utils/dispatch/signal.py:260)",
                     "_on_prerun (celery_ext/worker/observer.py:316)"]).startswith("task signals")
    assert layer_of([*DELIVER, "kept_strategy.<locals>.work (bench/floor.py:140)"]).startswith(
        "bench.floor's strategy")
    assert layer_of([*DELIVER, "kept_strategy.<locals>.work (bench/floor.py:140)",
                     "_make_job.<locals>.job (bench/app.py:128)"]).startswith("job body")
    assert layer_of(DELIVER[:6]).startswith("Celery strategy")
    assert layer_of([*DELIVER[:6], "BasePool.apply_async (celery/concurrency/base.py:140)",
                     "AsynPool.send_job (celery/concurrency/asynpool.py:850)"]).startswith(
        "pool hand-off")
    assert layer_of(DELIVER[:4]).startswith("Kombu message")
    assert layer_of([*DELIVER[:3], "loads (json/__init__.py:299)"]) == (
        "fetch: reply read and decoded")
    assert layer_of([*LOOP[:1], "Channel._brpop_start (celery_ext/transport/channel.py:688)"]) == (
        "fetch: request sent")
    assert layer_of(["Thread._bootstrap (threading.py:988)",
                     "Observer._run (celery_ext/worker/observer.py:226)"]).startswith("background")
    assert layer_of([*LOOP[:1], "_epoll.poll (kombu/utils/eventio.py:81)"]) == EVENT_LOOP


def test_the_report_splits_each_process_kinds_cpu_by_layer(tmp_path: Path) -> None:
    raw = tmp_path / "raw.txt"
    main = 'process 10:"celery worker"'
    child = 'process 11:"celery worker"'
    raw.write_text("\n".join([
        f"{main};{';'.join(DELIVER)};_make_job.<locals>.job (bench/app.py:128) 30",
        f"{main};{';'.join(LOOP)};_epoll.poll (kombu/utils/eventio.py:81) 10",
        f"{main};{';'.join(DELIVER[:4])} 60",
        f"{main};{child};{';'.join(DELIVER[5:])} 5",
    ]) + "\n")
    stacks = parse_stacks(raw, main_pid=10)
    assert stacks["main"]["layer"]["Kombu message and consumer callback"] == 60
    assert stacks["children"]["total"]["samples"] == 5
    text = report_stacks(stacks, top=5, cpu_us={"main": 1000.0, "children": 200.0})
    assert "(of 1000 us CPU per job)" in text
    assert "60.0%     600 us  Kombu message and consumer callback" in text
    assert "30.0%     300 us  job body" in text
    assert "100.0%     200 us  Celery tracer" in text  # the child's samples, its own CPU
