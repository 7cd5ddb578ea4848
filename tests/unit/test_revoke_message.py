"""``producer.control.revoke_arguments``: the task ids and ``terminate`` of Celery's
``revoke`` control message, as Kombu's channel carries it (base64 body, JSON)."""

from __future__ import annotations

from typing import Any

import pytest
from kombu import Connection
from kombu.utils.json import dumps

from celery_ext.producer.control import record_control, revoke_arguments


def envelope(method: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The envelope Kombu's virtual channel hands ``_put_fanout`` for a mailbox message
    (``kombu.pidbox.Mailbox._publish``)."""
    with Connection("memory://") as conn:
        channel = conn.default_channel
        body = dumps({"method": method, "arguments": arguments, "destination": None,
                      "pattern": None, "matcher": None})
        message: dict[str, Any] = channel.prepare_message(
            body, content_type="application/json", content_encoding="utf-8",
            headers={"clock": 1, "expires": 0})
        message["body"], message["properties"]["body_encoding"] = channel.encode_body(
            message["body"], "base64")
        return message


def decode(body: Any, encoding: str) -> Any:
    with Connection("memory://") as conn:
        return conn.default_channel.decode_body(body, encoding)


@pytest.mark.parametrize(("task_id", "ids"), [
    ("a", ["a"]), (["a", "b"], ["a", "b"]), (["a", "", None, 3], ["a"]), (None, [])])
def test_ids_one_or_a_list(task_id: Any, ids: list[str]) -> None:
    msg = envelope("revoke", {"task_id": task_id, "terminate": False, "signal": "TERM"})
    assert revoke_arguments(msg, decode) == (ids, False)


def test_terminate() -> None:
    msg = envelope("revoke", {"task_id": "a", "terminate": True, "signal": "KILL"})
    assert revoke_arguments(msg, decode) == (["a"], True)


@pytest.mark.parametrize("method", ["ping", "revoke_by_stamped_headers", "rate_limit"])
def test_other_commands_are_not_revokes(method: str) -> None:
    assert revoke_arguments(envelope(method, {"task_id": "a"}), decode) is None


def test_an_unreadable_message_is_published_as_it_is(caplog: pytest.LogCaptureFixture) -> None:
    """No Redis is touched (the client is None) and one line says why."""
    msg = envelope("revoke", {"task_id": "a"})
    msg["body"] = "not base64 json"
    assert record_control("celery.pidbox", msg, decode, None, None, None) is None  # type: ignore[arg-type]
    assert "could not be read" in caplog.text and len(caplog.records) == 1
    assert record_control("celeryev", msg, decode, None, None, None) is None  # type: ignore[arg-type]
