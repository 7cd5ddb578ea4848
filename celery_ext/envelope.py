"""The shape of a job as it sits in a job queue: Kombu's JSON envelope.

A producer writes ``{"body", "content-type", "content-encoding", "headers",
"properties": {"delivery_tag", "body_encoding", "delivery_info", ...}}``. Anything
can be pushed into a Redis list, though, and Kombu and Celery index into these
fields without checking their types: a ``headers`` list stops a worker with
"Unrecoverable error". The transport checks the shape first and sends a job that
fails it to the dead set (reason ``undecodable``) with the problem this names.
"""

from __future__ import annotations

from typing import Any

#: Top-level fields that must be strings when present.
_STRING_FIELDS = ("content-type", "content-encoding")
#: Properties that must be strings when present.
_STRING_PROPERTIES = ("body_encoding", "correlation_id", "reply_to")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


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
    return None
