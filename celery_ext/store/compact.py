"""The compact stored form of a job's message: what Redis holds, and the message it stands for.

Most of a Celery message (protocol 2) as Kombu writes it is headers at their default
values, a ``correlation_id`` and ``root_id`` equal to the task id, constant properties
and a base64 body: about 950 bytes for a job without arguments. The producer stores it
compact (:func:`pack`) and every reader gets the same message back (:func:`unpack`):
every field with its value and type, the keys in their order, the body byte for byte.

The compact form is still one JSON object, written with Kombu's separators, so the Lua
scripts that read fields by their text keep reading them::

    {"c": "hp", "headers": {<headers not at their default>},
     ["content-encoding": ..., "content-type": ...,] "args": "[[1, 2], {}",
     "properties": {<properties not at their default>, "delivery_tag": "...", ...}}

- ``c`` (first, the marker) says which sections dropped their defaults: ``h`` the
  headers, ``p`` the properties; a section that is not as Celery builds it (a key of
  the template below missing or out of order, a ``__type__`` key) is kept whole.
- ``headers`` comes first: the task id (``"id"``) and name (``"task"``) are its first
  keys, where ``include/job_index.lua`` and ``search.lua`` find them without a scan;
  the ``celery_ext_unique`` header is kept as it is.
- ``text`` is a base64 body decoded (a JSON body becomes its JSON text, escaped inside
  the string) when re-encoding it gives the stored body exactly; ``args`` is such a text
  without the end every protocol 2 body without callbacks has (:data:`NO_CALLBACKS`:
  ``[args, kwargs`` is left); any other body is kept as ``body``.
- ``properties`` comes last and keeps its order, so the delivery tag, ``enqueued_at``
  and ``fair_key`` stay at the payload's end (``include/delivery_tag.lua``,
  ``include/fair.lua``, ``queue_info.lua``).

A dropped value is one equal to its default in value and JSON type (``0`` is not
``false``); two defaults depend on the job: ``root_id`` and ``correlation_id`` on the
task id, ``delivery_info`` on the job queue, which every reader knows (a record names
it), hence the ``queue`` argument. A payload that does not start with the marker is
read as it is: messages stored before the compact form, and anything pushed by another
client. A message that is not Kombu's envelope is stored as it is too, unless its first
key is ``c``: that one is wrapped (``{"c": "whole", "message": ...}``).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from kombu.utils.json import dumps, loads

#: The compact form's first key; its value says which sections dropped their defaults.
MARKER = "c"
#: How a compact payload starts (Kombu's separators), for a reader of the text.
COMPACT_START = '{"c": "'
#: The flags of a message kept whole under "message" (its first key is the marker's).
WHOLE = "whole"
#: How a protocol 2 body without callbacks, errbacks, chain or chord ends (Kombu's JSON
#: of ``[args, kwargs, embed]``): a body stored as "args" is its text without this end.
NO_CALLBACKS = ', {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'
#: Kombu's envelope, in Kombu's order: a message with other top-level keys is kept whole.
ENVELOPE = ("body", "content-encoding", "content-type", "headers", "properties")
#: Defaults of the envelope's fields.
CONTENT_ENCODING, CONTENT_TYPE = "utf-8", "application/json"


class _TaskId:
    """A header's or property's default: the task id (the headers' ``id``)."""


class _Queue:
    """``delivery_info``'s default: the default exchange and the job queue."""


class _Kept:
    """A template key without a default: always kept, it only fixes the order."""


TASK_ID, QUEUE, KEPT = _TaskId(), _Queue(), _Kept()

#: Celery's protocol 2 headers in the order ``app.amqp.as_task_v2`` writes them, each
#: with its default.
HEADERS: tuple[tuple[str, Any], ...] = (
    ("lang", "py"), ("task", KEPT), ("id", KEPT), ("shadow", None), ("eta", None),
    ("expires", None), ("group", None), ("group_index", None), ("retries", 0),
    ("timelimit", [None, None]), ("root_id", TASK_ID), ("parent_id", None),
    ("argsrepr", "()"), ("kwargsrepr", "{}"), ("origin", KEPT), ("ignore_result", False),
    ("replaced_task_nesting", 0), ("stamped_headers", None), ("stamps", {}),
)
#: The properties Celery and Kombu write, in their order (a Kombu publish's other
#: properties come after ``reply_to``, ours after ``body_encoding``), with defaults.
PROPERTIES: tuple[tuple[str, Any], ...] = (
    ("correlation_id", TASK_ID), ("reply_to", ""), ("delivery_mode", 2),
    ("delivery_info", QUEUE), ("priority", 0), ("body_encoding", "base64"),
)
#: Each template's keys and their places, and its keys in order (by the template's id).
_POSITIONS = {id(t): {k: i for i, (k, _) in enumerate(t)} for t in (HEADERS, PROPERTIES)}
_KEYS = {id(t): tuple(k for k, _ in t) for t in (HEADERS, PROPERTIES)}


def _default(default: Any, task_id: Any, queue: str) -> Any:
    """A dropped value put back (a list or object a new one: a reader may change it)."""
    if default is TASK_ID:
        return task_id
    if default is QUEUE:
        return {"exchange": "", "routing_key": queue}
    if isinstance(default, list | dict):
        return default.copy()
    return default


def _at_default(value: Any, default: Any, task_id: Any, queue: str) -> bool:
    """Whether ``value`` is the default as JSON writes it: same type, same value, and for
    an object the same keys in the same order."""
    if default is TASK_ID:
        return type(value) is type(task_id) and value == task_id
    if default is QUEUE:
        return type(value) is dict and list(value.items()) == [("exchange", ""),
                                                               ("routing_key", queue)]
    return type(value) is type(default) and value == default


class _Plan:
    """How to rebuild a section of one shape (which keys were kept): its keys in their
    rebuilt order with the constant defaults in place, then what to set on a copy."""

    __slots__ = ("base", "copied", "kept", "queue", "task_id")

    def __init__(self, kept: dict[str, Any], template: tuple[tuple[str, Any], ...]) -> None:
        defaults = dict(template)
        self.base: dict[str, Any] = {}
        self.kept: list[str] = []
        self.task_id: list[str] = []
        self.queue: list[str] = []
        self.copied: list[str] = []
        for key in _order(kept, template, TASK_ID, ""):
            default = defaults.get(key)
            self.base[key] = default
            if key in kept:
                self.kept.append(key)
            elif default is TASK_ID:
                self.task_id.append(key)
            elif default is QUEUE:
                self.queue.append(key)
            elif isinstance(default, list | dict):
                self.copied.append(key)

    def apply(self, kept: dict[str, Any], task_id: Any, queue: str) -> dict[str, Any]:
        out = self.base.copy()  # (setting a key that is in it keeps the order)
        for key in self.kept:
            out[key] = kept[key]
        for key in self.task_id:
            out[key] = task_id
        for key in self.queue:
            out[key] = {"exchange": "", "routing_key": queue}
        for key in self.copied:
            out[key] = out[key].copy()
        return out


#: Plans by (template, kept keys): every fetch rebuilds two sections, and an app's jobs
#: come in a handful of shapes (which headers are not at their default).
_plans: dict[tuple[int, tuple[str, ...]], _Plan] = {}
#: Shapes remembered at most (a producer writing ever new header names cannot grow it).
MAX_PLANS = 512


def _rebuild(kept: dict[str, Any], template: tuple[tuple[str, Any], ...],
             task_id: Any, queue: str) -> dict[str, Any]:
    """A section from its kept keys (see :func:`_order`), through the plan of its shape."""
    shape = (id(template), tuple(kept))
    plan = _plans.get(shape)
    if plan is None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        plan = _plans[shape] = _Plan(kept, template)
    return plan.apply(kept, task_id, queue)


def _order(kept: dict[str, Any], template: tuple[tuple[str, Any], ...],
           task_id: Any, queue: str) -> dict[str, Any]:
    """A section from its kept keys: each dropped template key is put back just before
    the next kept template key, those after the last kept one right after it (no kept
    one: first); other keys stay where they are among the kept ones. The order depends
    on the kept keys alone, which :func:`_rebuild` relies on."""
    positions = _POSITIONS[id(template)]
    out: dict[str, Any] = {}
    last = next((k for k in reversed(kept) if k in positions), None)
    at = 0  # the next template key not yet placed
    if last is None:
        at = _fill(out, kept, template, at, len(template), task_id, queue)
    for key, value in kept.items():
        if key in positions:
            at = _fill(out, kept, template, at, positions[key], task_id, queue)
            out[key] = value
            at += 1
            if key == last:
                at = _fill(out, kept, template, at, len(template), task_id, queue)
        else:
            out[key] = value
    return out


def _fill(out: dict[str, Any], kept: dict[str, Any], template: tuple[tuple[str, Any], ...],
          start: int, stop: int, task_id: Any, queue: str) -> int:
    """Put the dropped template keys ``template[start:stop]`` back in ``out``."""
    for key, default in template[start:stop]:
        if key not in kept:
            out[key] = _default(default, task_id, queue)
    return max(start, stop)


def _pack_section(section: dict[str, Any], template: tuple[tuple[str, Any], ...],
                  task_id: Any, queue: str) -> dict[str, Any] | None:
    """``section`` without its values at their defaults, or None when it cannot be
    rebuilt exactly (a template key missing or out of order, a ``__type__`` key)."""
    if "__type__" in section:
        return None
    kept: dict[str, Any] = {}
    if tuple(section)[:len(template)] == _KEYS[id(template)]:
        # As Celery and Kombu write it: the template's keys first, in order (then any
        # others), which the rebuild gives back as they are.
        items = iter(section.items())
        for (key, default), (_, value) in zip(template, items, strict=False):
            if default is KEPT or not _at_default(value, default, task_id, queue):
                kept[key] = value
        kept.update(items)
        return kept
    positions = _POSITIONS[id(template)]
    found = 0
    for key, value in section.items():
        at = positions.get(key)
        if at is None:
            kept[key] = value
            continue
        found += 1
        default = template[at][1]
        if default is KEPT or not _at_default(value, default, task_id, queue):
            kept[key] = value
    if found != len(template):
        return None
    if list(_rebuild(kept, template, task_id, queue)) != list(section):
        return None  # its keys are in an order the rebuild would not give back
    return kept


def _text_of(body: Any, props: dict[str, Any]) -> str | None:
    """The body decoded, when it is base64 of UTF-8 text that encodes back to it."""
    if props.get("body_encoding") != "base64" or not isinstance(body, str):
        return None
    try:
        raw = base64.b64decode(body, validate=True)
        text = raw.decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    return text if base64.b64encode(raw).decode("ascii") == body else None


def pack(message: Any, queue: str) -> str:
    """The payload stored for ``message`` published to ``queue`` (see the module
    docstring); ``unpack(pack(m, q), q)`` is ``m`` as JSON reads it back."""
    if not (isinstance(message, dict) and tuple(message) == ENVELOPE
            and isinstance(message["headers"], dict)
            and isinstance(message["properties"], dict)):
        whole = str(dumps(message))
        if isinstance(message, dict) and next(iter(message), None) == MARKER:
            return str(dumps({MARKER: WHOLE, "message": message}))
        return whole
    headers, props = message["headers"], message["properties"]
    task_id = headers.get("id", TASK_ID)  # (no id: a default of the task id never matches)
    flags = ""
    packed_headers = _pack_section(headers, HEADERS, task_id, queue)
    if packed_headers is not None:
        headers, flags = packed_headers, "h"
    packed_props = _pack_section(props, PROPERTIES, task_id, queue)
    if packed_props is not None:
        flags += "p"
    compact: dict[str, Any] = {MARKER: flags, "headers": headers}
    for key, default in (("content-encoding", CONTENT_ENCODING),
                         ("content-type", CONTENT_TYPE)):
        if not _at_default(message[key], default, None, queue):
            compact[key] = message[key]
    text = _text_of(message["body"], props)
    if text is not None and text.endswith(NO_CALLBACKS) and text.startswith("["):
        compact["args"] = text[:-len(NO_CALLBACKS)]
    elif text is not None:
        compact["text"] = text
    else:
        compact["body"] = message["body"]
    compact["properties"] = props if packed_props is None else packed_props
    try:
        return json.dumps(compact)  # the C encoder: Kombu's writes the same JSON values
    except TypeError:
        return str(dumps(compact))  # a value Kombu's encoder writes (a datetime, a UUID...)


def parse(payload: str | bytes) -> Any:
    """A stored payload's JSON as Kombu's ``loads`` reads it: Kombu's object hook turns
    each ``{"__type__": ..., "__value__": ...}`` object into a value, and costs a Python
    call per JSON object; without such an object in the payload, the C decoder alone
    gives the same result. Raises ValueError for a payload that is not JSON."""
    if isinstance(payload, bytes):
        if b'"__type__"' not in payload:
            return json.loads(payload)
        payload = payload.decode("utf-8")
    elif '"__type__"' not in payload:
        return json.loads(payload)
    return loads(payload)


def unpack(payload: str | bytes, queue: str) -> Any:
    """The message a stored payload of ``queue`` stands for (any JSON value for a
    payload that is not compact and not a JSON object); ValueError when it is not JSON
    or a compact form is broken."""
    return expand(parse(payload), queue)


def expand(stored: Any, queue: str) -> Any:
    """The message of a parsed stored payload (see :func:`unpack`)."""
    if not isinstance(stored, dict) or not isinstance(stored.get(MARKER), str) \
            or next(iter(stored)) != MARKER:
        return stored
    flags = stored[MARKER]
    if flags == WHOLE:
        return stored.get("message")
    try:
        headers, props = stored["headers"], stored["properties"]
        if "h" in flags:
            headers = _rebuild(headers, HEADERS, headers.get("id"), queue)  # id is kept
        if "p" in flags:
            task_id = headers.get("id", TASK_ID) if isinstance(headers, dict) else TASK_ID
            props = _rebuild(props, PROPERTIES, task_id, queue)
        text = stored["args"] + NO_CALLBACKS if "args" in stored else stored.get("text")
        if text is not None:
            body = base64.b64encode(text.encode("utf-8")).decode("ascii")
        else:
            body = stored["body"]
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"a broken compact message ({type(exc).__name__}: {exc})") from None
    return {"body": body,
            "content-encoding": stored.get("content-encoding", CONTENT_ENCODING),
            "content-type": stored.get("content-type", CONTENT_TYPE),
            "headers": headers, "properties": props}


def headers_of(payload: str | bytes) -> dict[str, Any]:
    """The headers of a stored payload's message (they do not depend on its queue); empty
    when it has none or is not JSON. For readers of the task id, name or unique lock."""
    try:
        message = unpack(payload, "")
    except (ValueError, UnicodeDecodeError):
        return {}
    headers = message.get("headers") if isinstance(message, dict) else None
    return headers if isinstance(headers, dict) else {}
