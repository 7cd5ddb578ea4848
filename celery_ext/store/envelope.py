"""The shape of a job as it sits in a job queue: Kombu's JSON envelope.

A producer writes ``{"body", "content-type", "content-encoding", "headers",
"properties": {"delivery_tag", "body_encoding", "delivery_info", ...}}``. Anything
can be pushed into a Redis list, though, and Kombu and Celery index into these
fields without checking their types: a ``headers`` list stops a worker with
"Unrecoverable error". The transport checks the shape first and sends a job that
fails it to the dead set (reason ``undecodable``) with the problem this names.

The task id and task name are printed in log lines, ours and Celery's ("Received
task: name[id]"), so one holding a control character (a newline, a terminal escape,
a line separator) could forge log lines: such a job is refused here too, before any
log line sees it, and the problem names the field with its value escaped.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from celery_ext.store.compact import unpack

#: Top-level fields that must be strings when present.
_STRING_FIELDS = ("content-type", "content-encoding")
#: Properties that must be strings when present.
_STRING_PROPERTIES = ("body_encoding", "correlation_id", "reply_to")
#: Fields of a task message that end up in log lines: (field, what it is called).
_LOGGED_FIELDS = (("id", "task id"), ("task", "task name"))
#: Characters of an unsafe value shown (escaped) in the problem.
_SHOWN_CHARS = 80


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def decode_message(payload: str | bytes, queue: str) -> dict[str, Any]:
    """The Kombu message of a payload stored in ``queue``'s records (a queued, in-flight,
    dead or scheduled job's: compact or not, see ``compact.py``) as a dict; empty when
    it is not a JSON object. Read by the admin side, the result backend, the worker."""
    try:
        message = unpack(payload, queue)
    except ValueError:
        return {}
    return message if isinstance(message, dict) else {}


def envelope_problem(raw: Any) -> str | None:
    """Why ``raw`` (a parsed job) cannot be handed to Kombu, or None if it can."""
    if not isinstance(raw, dict):
        return f"the message is {_kind(raw)}, not a JSON object"
    props = raw.get("properties")
    if not isinstance(props, dict):
        return "the message has no properties object" if props is None else \
            f"its properties are {_kind(props)}, not an object"
    headers = raw.get("headers")
    if headers is not None and not isinstance(headers, dict):
        return f"its headers are {_kind(headers)}, not an object"
    info = props.get("delivery_info")
    if info is not None and not isinstance(info, dict):
        return f"its delivery_info is {_kind(info)}, not an object"
    body = raw.get("body")
    if body is not None and not isinstance(body, str):
        return f"its body is {_kind(body)}, not a string"
    for name in _STRING_FIELDS:
        if raw.get(name) is not None and not isinstance(raw[name], str):
            return f"its {name} is {_kind(raw[name])}, not a string"
    for name in _STRING_PROPERTIES:
        if props.get(name) is not None and not isinstance(props[name], str):
            return f"its property {name} is {_kind(props[name])}, not a string"
    return logged_field_problem(raw)


def logged_field_problem(raw: dict[str, Any]) -> str | None:
    """Why the task id or name of ``raw`` (a well-shaped envelope) must not reach a log
    line, or None: a control character (anything ``str.isprintable`` refuses).

    Protocol 2 carries both in the headers; a message whose headers have no ``task``
    is read by Celery as protocol 1, with both in its body (checked when that is JSON).
    """
    headers = raw.get("headers")
    if isinstance(headers, dict) and "task" in headers:
        fields: Any = headers
    elif isinstance(headers, dict):
        fields = _protocol1_body(raw)
    else:
        return None  # no headers: Celery does not read it as a task message
    if not isinstance(fields, dict):
        return None
    for name, label in _LOGGED_FIELDS:
        value = fields.get(name)
        if isinstance(value, str) and not value.isprintable():
            shown = repr(value[:_SHOWN_CHARS])  # repr escapes every unprintable character
            return f"its {label} {shown} holds control characters (it would forge log lines)"
    return None


def _protocol1_body(raw: dict[str, Any]) -> Any:
    """The decoded JSON body of a protocol 1 message, or None if it is not JSON."""
    body = raw.get("body")
    if not isinstance(body, str) or raw.get("content-type") != "application/json":
        return None
    try:
        if raw["properties"].get("body_encoding") == "base64":
            return json.loads(base64.b64decode(body, validate=True))
        return json.loads(body)
    except (ValueError, binascii.Error):  # the body checks after this one say why
        return None
