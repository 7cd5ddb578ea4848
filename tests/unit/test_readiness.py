"""ReadyQueues: which job queues a channel fetches from (pure bookkeeping, no server)."""

from __future__ import annotations

from celery_ext.transport.readiness import ReadyQueues


def ready(*names: str) -> ReadyQueues:
    r = ReadyQueues(default_weight=1)
    for name in names:
        r.add(name, 1)
    return r


def test_an_empty_reply_deactivates_and_a_wake_up_reactivates() -> None:
    r = ready("a", "b")
    r.fetch_sent()
    assert r.fetch_replied(["a"]) is False
    assert r.sched.active == {"b"}
    r.woken(["a"])
    assert r.sched.active == {"a", "b"}


def test_a_wake_up_read_during_a_fetch_outlives_its_empty_reply() -> None:
    r = ready("a")
    r.fetch_sent()
    r.woken(["a"])  # the push happened after Redis ran the fetch
    r.fetch_replied(["a"])
    assert r.sched.active == {"a"}
    r.fetch_sent()  # only wake-ups during that fetch counted
    r.fetch_replied(["a"])
    assert r.sched.active == set()


def test_a_subscription_during_a_fetch_asks_for_a_ready_reread() -> None:
    r = ready("a", "b")
    r.fetch_sent()
    r.fetch_replied(["a", "b"])
    r.fetch_sent()
    r.subscribed()
    assert r.fetch_replied(["a", "b"]) is True  # the caller re-reads the ready set
    assert r.sched.active == set()
    r.subscribed()  # between fetches: everything is worth a look, no re-read needed
    assert r.sched.active == {"a", "b"}
    r.fetch_sent()
    assert r.fetch_replied([]) is False


def test_a_lost_fetch_activates_every_queue() -> None:
    r = ready("a", "b")
    r.fetch_sent()
    r.fetch_replied(["a", "b"])
    r.fetch_sent()
    r.fetch_lost()
    assert r.sched.active == {"a", "b"}
    r.woken(["a"])  # not fetching anymore: nothing remembered
    r.fetch_sent()
    r.fetch_replied(["a"])
    assert r.sched.active == {"b"}


def test_a_throttled_queue_sleeps_until_due_unless_woken() -> None:
    """A rate-limited queue refused by fetch stays inactive until its due time: the
    ready refresh does not wake it, the due time does; a wake-up does at once."""
    r = ready("a", "b")
    r.fetch_sent()
    r.fetch_replied(["a"])
    r.throttle([("a", 0.5), ("gone", 0.1)], now=100.0)  # (a queue not consumed: ignored)
    assert r.next_due() == 100.5
    r.woken(["a", "b"], refresh=True)
    assert r.sched.active == {"b"}
    r.release_due(100.4)
    assert r.sched.active == {"b"} and r.next_due() == 100.5
    r.release_due(100.5)
    assert r.sched.active == {"a", "b"} and r.next_due() is None
    r.fetch_sent()
    r.fetch_replied(["a"])
    r.throttle([("a", 0.5)], now=200.0)
    r.woken(["a"])  # e.g. its limit changed
    assert r.sched.active == {"a", "b"}
