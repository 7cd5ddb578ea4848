"""Observer counters: summed in memory, written to the stats hash in one command."""

from __future__ import annotations

import time

import redis

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
