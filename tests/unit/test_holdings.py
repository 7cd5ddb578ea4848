"""Holdings: what a process holds of its pool's in-flight record (pure, no server).

End to end (lost fetch replies, connection cuts, lost acks against real workers) it is
tested in tests/integration/test_configurations.py."""

from __future__ import annotations

import gc

from celery_ext.worker.holdings import Holdings


class Message:
    """Stands in for a Kombu message: only its liveness matters here."""


def test_a_message_is_held_while_referenced_and_until_its_ack_is_confirmed() -> None:
    h = Holdings()
    kept, dropped = Message(), Message()
    h.delivered("kept", kept)
    h.delivered("dropped", dropped)
    del dropped
    gc.collect()
    assert h.held() == {"kept"}  # Celery let go of "dropped": it is returned
    h.acking(["kept"])
    del kept
    gc.collect()
    assert h.held() == {"kept"}  # its ack is under way: not returned, not forgotten
    h.unconfirmed(["kept"])
    assert h.held() == {"kept"} and h.to_replay() == ["kept"]
    h.confirmed(["kept"])
    assert h.held() == set() and h.to_replay() == []


def test_released_tags_are_not_held_and_delivery_order_is_kept() -> None:
    h = Holdings()
    messages = [Message() for _ in range(3)]
    for i, m in enumerate(messages):
        h.delivered(f"t{i}", m)
    assert h.delivery_order() == ["t0", "t1", "t2"]
    h.released(["t1"])
    assert h.held() == {"t0", "t2"}
    assert h.delivery_order() == ["t0", "t2"]
