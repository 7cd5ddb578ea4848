"""Observer counters: summed in memory, written to the stats hash in one command; busy
records; stop requests, answered by checkins."""

from __future__ import annotations

import time

import redis

from celery_ext.admin.job_status import JobLookup
from celery_ext.admin.overview import State
from celery_ext.config import Settings
from celery_ext.store.keys import Keys
from celery_ext.worker.observer import BUSY_RECORD_DELAY, Observer

K = Keys("celery_ext")


def test_counters_of_many_job_names_are_summed_and_written_exactly(
        redis_client: redis.Redis) -> None:
    obs = Observer(redis_client, Settings(), "pool-obs")
    names = [f"job_{i:04d}" for i in range(1000)]
    for round_ in range(2):
        for i, name in enumerate(names):
            obs.job_finished(f"{round_}-{i}", name, "processed")
            if i % 10 == 0:
                obs.job_finished(f"{round_}-{i}-f", name, "failed")
        obs.job_finished(f"{round_}-r", names[0], "retried")
        obs.flush(force_stats=True)
        assert not obs._stats  # written, not kept
    stats = {k.decode(): int(v) for k, v in redis_client.hgetall(K.stats).items()}
    assert stats["processed"] == 2000 and stats["failed"] == 200 and stats["retried"] == 2
    assert all(stats[f"processed:{n}"] == 2 for n in names)
    assert sum(v for k, v in stats.items() if k.startswith("failed:")) == 200
    assert stats["failed:job_0010"] == 2 and "failed:job_0011" not in stats
    assert len(stats) == 3 + 1000 + 100 + 1
    # What the dashboard and CLI read back.
    assert State(redis_client).totals() == {"processed": 2000, "failed": 200, "retried": 2}


class _Task:
    name = "obs.long"
    stall_after = 30


class _Unprintable:
    def __repr__(self) -> str:
        raise ValueError("no repr")


def test_busy_record_is_made_when_written_and_survives_a_bad_repr(
        redis_client: redis.Redis) -> None:
    """A job's busy record is built past the delay, from the arguments it started with;
    an argument whose repr() raises costs its preview, not the record (nor the others)."""
    obs = Observer(redis_client, Settings(), "pool-obs")
    state = State(redis_client)
    redis_client.zadd(K.pools, {"pool-obs": 0})  # busy_workers lists registered pools
    obs.job_started(_Task(), "job-ok", ("long", 3), {"k": 1})
    obs.job_started(_Task(), "job-bad", (_Unprintable(),), {})
    assert state.busy_workers() == []  # nothing written before the delay
    obs._running["job-bad"].slot = "other-slot"  # two slots, as two threads would have
    obs.flush()
    assert state.busy_workers() == []
    time.sleep(BUSY_RECORD_DELAY)
    obs.flush()
    busy = {b["job_id"]: b for b in state.busy_workers()}
    assert busy["job-ok"]["args"] == "'long', 3, k=1" and busy["job-ok"]["stall_after"] == 30
    assert busy["job-ok"]["job_name"] == "obs.long"
    assert busy["job-bad"]["args"] == "<arguments not shown: ValueError>"
    obs.job_finished("job-ok", "obs.long", "processed")
    obs.job_finished("job-bad", "obs.long", "failed")
    assert state.busy_workers() == []  # written records are cleared with their jobs


def test_stop_requests_are_taken_for_jobs_in_flight_only_and_lapse(
        redis_client: redis.Redis) -> None:
    """The stop requests cannot grow without bound: asking to stop a job that is not in
    flight (never was, or ended) records nothing; a running job's request is answered
    by its checkins until the job ends, which removes it, or ``stop_request_ttl``
    passes; each request drops the lapsed ones."""
    settings = Settings(stop_request_ttl=0.5)
    state = State(redis_client, settings)
    lookup = JobLookup(redis_client, settings)

    def checkin(job_id: str) -> bool:  # a fresh observer: checkins are throttled per job
        return Observer(redis_client, settings, "pool-obs").checkin(job_id, "step", 0.5)[0]

    assert not any(state.request_stop(f"nobody-{i}") for i in range(1000))
    assert not redis_client.exists(K.stop_requests)

    # In flight by its checkin record (the job index may be off)...
    assert checkin("job-1") is False
    assert state.request_stop("job-1") is True
    assert checkin("job-1") is True and lookup.status("job-1")["stop_requested"]
    # ... or by the job index, which says where every job is.
    redis_client.hset(K.job_index, mapping={"job-2": "inflight\n1\nq\ntag-2\npool-obs",
                                            "job-3": "done\n1\nq\ntag-3\npool-obs"})
    assert state.request_stop("job-2") is True and state.request_stop("job-3") is False

    time.sleep(0.6)  # both lapse: no checkin answers them any more
    assert checkin("job-1") is False and not lookup.status("job-1")["stop_requested"]
    obs = Observer(redis_client, settings, "pool-obs")
    obs.checkin("job-4")
    assert state.request_stop("job-4") is True
    assert redis_client.zrange(K.stop_requests, 0, -1) == [b"job-4"]  # lapsed ones dropped

    obs.job_finished("job-4", "obs.long", "processed")  # its end removes its request
    assert not redis_client.exists(K.stop_requests)
    assert state.request_stop("job-4") is False  # ended: not in flight


def test_jobs_start_and_end_while_a_flush_writes_the_counters(
        redis_client: redis.Redis) -> None:
    """A flush writes a field per job name that ran (thousands of names: tens of ms of
    round trips); every job's start and end take the observer's lock, and they do not
    wait for those writes (they waited once a second, every job slot of the worker at
    once). Here the counters' write is held until the test lets it go: a job starts and
    ends meanwhile, and its counts are written by the next flush, none lost."""
    import threading

    obs = Observer(redis_client, Settings(), "pool-obs")
    for i in range(100):
        obs.job_finished(f"before-{i}", f"job_{i:03d}", "processed")
    writing, release = threading.Event(), threading.Event()
    scripts = obs.history.scripts  # the flush's one call: history.lua, with the counters

    def held(name: str, keys: list[str], args: list[object]) -> object:
        if name == "history" and K.stats in keys:
            writing.set()
            assert release.wait(30)
        return scripts(name, keys, args)

    obs.history.scripts = held  # type: ignore[assignment]
    flusher = threading.Thread(target=obs.flush, kwargs={"force_stats": True})
    flusher.start()
    try:
        assert writing.wait(30)
        during = threading.Thread(target=lambda: (
            obs.job_started(_Task(), "during", (), {}),
            obs.job_finished("during", "job_during", "processed")))
        during.start()
        during.join(30)
        assert not during.is_alive()  # done while the flush's write is still held
    finally:
        release.set()
        flusher.join(30)
    obs.history.scripts = scripts  # type: ignore[assignment]
    obs.flush(force_stats=True)
    stats = {k.decode(): int(v) for k, v in redis_client.hgetall(K.stats).items()}
    assert stats["processed"] == 101 and stats["processed:job_during"] == 1
    obs.stop()
