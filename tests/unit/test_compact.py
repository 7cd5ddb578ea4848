"""``store.compact``: the stored form of a message gives back the same message.

``unpack(pack(m, q), q)`` is ``m`` as JSON reads it back, with its keys in the same order
(the text Kombu would write is the same), for generated messages and for messages Celery
and Kombu build (captured from Kombu's in-memory transport, then stamped as our producer
stamps them); old payloads (full JSON) and other clients' payloads read as they are.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, chord, group, signature
from hypothesis import given, settings
from hypothesis import strategies as st
from kombu import Connection
from kombu.utils.json import dumps

from celery_ext.options.fair import place_last
from celery_ext.store import compact
from celery_ext.store.compact import HEADERS, PROPERTIES, WHOLE, pack, unpack

QUEUE = "tasks.add"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8)
task_ids = st.sampled_from(["0d6b4f0e-7a1b-4c8e-9d35-3a3f1f0e2b11", "x", ""]) | st.text()


def _value(default: Any, task_id: Any, queue: str) -> st.SearchStrategy[Any]:
    """A template field's value: mostly its default (or what looks like it)."""
    if default.__class__.__name__ == "_TaskId":
        return st.just(task_id) | task_ids
    if default.__class__.__name__ == "_Queue":
        return st.sampled_from([{"exchange": "", "routing_key": queue},
                                {"routing_key": queue, "exchange": ""},
                                {"exchange": "celery", "routing_key": queue},
                                {"exchange": "", "routing_key": queue, "redelivered": True}])
    if default.__class__.__name__ == "_Kept":
        return json_values
    near = [default, False if default == 0 else 0, [None, 0] if default == [None, None] else None]
    return st.sampled_from(near) | json_values


@st.composite
def sections(draw: st.DrawFn, template: tuple[tuple[str, Any], ...], task_id: Any,
             queue: str) -> dict[str, Any]:
    """A headers or properties dict: the template's keys (sometimes some missing or out
    of order), others among and after them."""
    keys = [k for k, _ in template]
    if draw(st.integers(0, 9)) == 7:
        keys = draw(st.permutations(keys))
    if draw(st.integers(0, 9)) == 7:
        keys = keys[:draw(st.integers(0, len(keys)))]
    defaults = dict(template)
    out: dict[str, Any] = {}
    for key in keys:
        if draw(st.integers(0, 7)) == 5:
            out[draw(st.text(min_size=1, max_size=8))] = draw(json_values)  # an extra
        out[key] = draw(_value(defaults[key], task_id, queue))
    for extra in draw(st.lists(st.sampled_from(
            ["delivery_tag", "enqueued_at", "fair_key", "celery_ext_unique", "c", "text",
             "__type__", "body"]), max_size=3, unique=True)):
        out[extra] = draw(json_values)
    return out


@st.composite
def bodies(draw: st.DrawFn) -> tuple[Any, str | None]:
    """(body, body_encoding)."""
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return base64.b64encode(draw(st.binary(max_size=40))).decode(), "base64"
    if kind == 1:
        text = dumps(draw(json_values))
        return base64.b64encode(text.encode()).decode(), "base64"
    if kind == 2:
        return base64.b64encode(draw(st.text()).encode()).decode() + draw(
            st.sampled_from(["", "\n", "=="])), "base64"
    if kind == 3:
        return draw(st.text()), draw(st.sampled_from(["utf-8", None]))
    return draw(json_values), draw(st.sampled_from(["base64", None]))


@st.composite
def messages(draw: st.DrawFn) -> Any:
    """Kombu envelopes built like Celery's (mostly), or anything else."""
    if draw(st.integers(0, 9)) == 7:
        return draw(json_values)
    queue = draw(st.sampled_from([QUEUE, "", "q\n\u00e9"]))
    task_id = draw(task_ids)
    headers = draw(sections(HEADERS, task_id, queue))
    if "id" in headers:
        headers["id"] = task_id
    props = draw(sections(PROPERTIES, task_id, queue))
    body, encoding = draw(bodies())
    if encoding is not None and "body_encoding" in props:
        props["body_encoding"] = encoding
    message = {"body": body,
               "content-encoding": draw(st.sampled_from(["utf-8", "binary", None])),
               "content-type": draw(st.sampled_from(["application/json", "application/x"])),
               "headers": headers, "properties": props}
    if draw(st.integers(0, 9)) == 7:
        del message[draw(st.sampled_from(list(message)))]
    if draw(st.integers(0, 19)) == 13:
        message = {"c": 1, **message}
    return queue, message


def as_stored(value: Any) -> Any:
    """What JSON gives back for ``value`` (tuples become lists, and so on)."""
    return json.loads(dumps(value))


@settings(max_examples=400, deadline=None)
@given(messages())
def test_generated_messages_come_back_whole(case: Any) -> None:
    queue, message = case if isinstance(case, tuple) else (QUEUE, case)
    back = unpack(pack(message, queue), queue)
    assert back == as_stored(message)
    assert dumps(back) == dumps(as_stored(message))  # the same keys in the same order


@settings(deadline=None)
@given(json_values)
def test_old_payloads_read_as_they_are(value: Any) -> None:
    text = dumps(value)
    if isinstance(value, dict) and next(iter(value), None) == "c":
        return  # (the marker's key: such a payload is stored wrapped, below)
    assert unpack(text, QUEUE) == json.loads(text)
    assert unpack(text.encode(), QUEUE) == json.loads(text)


def test_a_message_starting_with_the_marker_key_is_wrapped() -> None:
    message = {"c": "hp", "headers": {}}
    stored = pack(message, QUEUE)
    assert json.loads(stored) == {"c": WHOLE, "message": message}
    assert unpack(stored, QUEUE) == message


# -- messages as Celery and Kombu build them -------------------------------------------------
app = Celery("compact", broker="memory://", backend="cache+memory://", set_as_current=False)


@app.task(name=QUEUE)
def add(x: Any = 0, y: Any = 0) -> Any:
    return x + y


def published(**options: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """The messages ``add.apply_async(**options)`` publishes, as our producer stores them
    (``enqueued_at``, the fair key last)."""
    with Connection("memory://") as conn:
        result = add.apply_async(connection=conn, **options) if "sig" not in options \
            else options.pop("sig").apply_async(connection=conn, **options)
        assert result.id
        channel = conn.default_channel
        for queue in (QUEUE, "celery", "other"):
            while True:
                try:
                    message = channel._get(queue)
                except Exception:
                    break
                message["properties"]["enqueued_at"] = 1795810656.888
                place_last(message["properties"])
                yield queue, message


CELERY_CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "args": {"args": (1, 2)},
    "kwargs and unicode": {"kwargs": {"x": "h\u00e9llo \u2603 \U0001f600", "y": "\"q\"\\"}},
    "countdown": {"args": (1, 2), "countdown": 30},
    "eta and expires": {"eta": "2030-01-01T00:00:00+00:00", "expires": 600},
    "priority": {"priority": 7},
    "fair key": {"fair_key": "customer-42"},
    "unique header": {"headers": {"celery_ext_unique": "abc123", "celery_ext_unique_mode":
                                  "finished"}},
    "links": {"link": signature("other.task"), "link_error": signature("err.task")},
    "shadow, limits, retries": {"shadow": "nick", "time_limit": 10, "soft_time_limit": 5,
                                "retries": 3, "ignore_result": True},
    "group ids": {"group_id": "g-1", "group_index": 4},
    "root and parent": {"root_id": "r-1", "parent_id": "p-1"},
    "other queue": {"queue": "other"},
    "a chain": {"sig": add.si(1, 2) | add.s(3) | add.s(4)},
    "a group": {"sig": group(add.si(i, i) for i in range(3))},
    "a chord": {"sig": chord([add.si(1, 1), add.si(2, 2)], add.s())},
    "correlation id apart": {"task_id": "t-1", "headers": {"x": [1, {"y": None}]}},
}


@pytest.mark.parametrize("options", CELERY_CASES.values(), ids=list(CELERY_CASES))
def test_celery_messages_come_back_whole(options: dict[str, Any]) -> None:
    found = list(published(**dict(options)))
    assert found
    for queue, message in found:
        stored = pack(message, queue)
        assert unpack(stored, queue) == as_stored(message)
        assert dumps(unpack(stored, queue)) == dumps(message)  # byte for byte
        assert unpack(stored.encode(), queue) == as_stored(message)


@pytest.mark.parametrize("max_plans", [512, 1])
def test_each_shape_is_rebuilt_by_its_own_plan(max_plans: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Sections are rebuilt through a plan kept per shape (which keys were kept): messages
    of every shape, interleaved and read twice, come back whole, with the plans kept and
    with one plan at a time (each new shape clears the rest); and a rebuilt default list
    or object is the reader's own, not the plan's."""
    monkeypatch.setattr(compact, "_plans", {})
    monkeypatch.setattr(compact, "MAX_PLANS", max_plans)
    found = [m for options in CELERY_CASES.values() for m in published(**dict(options))]
    stored = [(queue, pack(message, queue), message) for queue, message in found]
    assert len({tuple(json.loads(p)["headers"]) for _, p, _ in stored}) > 1  # several shapes
    for _ in range(2):
        for queue, payload, message in stored:
            back = unpack(payload, queue)
            assert dumps(back) == dumps(message)
            back["headers"]["timelimit"].append("changed")
            back["headers"]["stamps"]["changed"] = True
            back["properties"]["delivery_info"]["changed"] = True
    assert len(compact._plans) <= max_plans


def test_a_binary_body_is_kept_as_it_is() -> None:
    with Connection("memory://") as conn:
        conn.Producer().publish(b"\x00\xff\xfe binary", routing_key="raw",
                                content_type="application/data", content_encoding="binary",
                                declare=[conn.SimpleQueue("raw").queue])
        message = conn.default_channel._get("raw")
    stored = pack(message, "raw")
    assert '"body": "' in stored and '"text"' not in stored
    assert unpack(stored, "raw") == message


def test_a_default_message_is_stored_in_under_300_bytes() -> None:
    """The memory per queued job (issue 36): a no-argument job is 950 bytes whole."""
    [(queue, message)] = published()
    whole, stored = dumps(message), pack(message, queue)
    assert len(whole) > 900
    assert len(stored) < 300
    # What the Lua scripts read stays readable by its text: the task id and name first,
    # the delivery tag and enqueue stamp last.
    assert stored.startswith('{"c": "hp", "headers": {"task": "tasks.add", "id": "')
    tag = message["properties"]["delivery_tag"]
    assert stored.endswith(f'"delivery_tag": "{tag}", "enqueued_at": 1795810656.888}}}}')
