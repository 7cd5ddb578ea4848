"""Observer counters: summed in memory, written to the stats hash in one command."""

from __future__ import annotations

import redis

from celery_ext.config import Settings
from celery_ext.keys import Keys
from celery_ext.observer import Observer
from celery_ext.state import State

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
