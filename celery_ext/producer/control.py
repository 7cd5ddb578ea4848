"""Celery's remote-control messages as a producer publishes them: a revoke becomes state.

Every way of revoking in Celery (``app.control.revoke``, ``AsyncResult.revoke``,
``celery control revoke``, Flower's button) ends as a ``revoke`` broadcast on the
mailbox's fanout exchange (``celery.pidbox``), which the process that sends it publishes
through this transport's channel (``Channel._put_fanout``). Recording the revoke there,
before the broadcast goes out, makes it hold whether or not a worker is up to hear it
(``store/revoked.py``).

``revoke_by_stamped_headers`` is left to Celery (the workers up at the time): a stamp is
not an id the fetch can look up in O(1).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kombu.serialization import loads

from celery_ext.config import Settings
from celery_ext.store.revoked import RevokeOutcome, revoke, sender
from celery_ext.store.scripts import Scripts
from celery_ext.text import one_line

logger = logging.getLogger("celery_ext.producer.control")

#: The suffix of a Kombu mailbox's fanout exchange (Celery's is ``celery.pidbox``).
MAILBOX_SUFFIX = ".pidbox"
#: How the revoke records say it came: Celery's revoke broadcast, whoever sent it.
VIA_CONTROL = "celery control revoke"


def revoke_arguments(message: Any, decode_body: Callable[[Any, str], Any]
                     ) -> tuple[list[str], bool] | None:
    """The task ids and ``terminate`` of a Kombu envelope carrying Celery's ``revoke``
    control command, or None for any other message. ``decode_body``: the channel's
    (Kombu's body encodings)."""
    if not isinstance(message, dict) or not isinstance(message.get("properties"), dict):
        return None
    body = message.get("body")
    encoding = message["properties"].get("body_encoding")
    if encoding:
        body = decode_body(body, encoding)
    command = loads(body, message.get("content-type"), message.get("content-encoding"))
    if not isinstance(command, dict) or command.get("method") != "revoke":
        return None
    arguments = command.get("arguments")
    if not isinstance(arguments, dict):
        return None
    task_id = arguments.get("task_id")
    ids = task_id if isinstance(task_id, list | tuple | set) else [task_id]
    return [i for i in ids if isinstance(i, str) and i], bool(arguments.get("terminate"))


def record_control(exchange: str, message: Any, decode_body: Callable[[Any, str], Any],
                   client: Any, scripts: Scripts, settings: Settings) -> RevokeOutcome | None:
    """Record the revoke a control message carries (see the module's docstring); None
    for any other message. A revoke message that cannot be read is logged on one line
    and published as it is (the workers up still get it)."""
    if not exchange.endswith(MAILBOX_SUFFIX):
        return None
    try:
        found = revoke_arguments(message, decode_body)
    except Exception as exc:
        logger.warning("celery_ext: a remote-control message could not be read, so a revoke "
                       "in it is not recorded in Redis: %s", one_line(f"{exc}"))
        return None
    if not found or not found[0]:
        return None
    ids, terminate = found
    return revoke(client, scripts, settings, ids, by=sender(), via=VIA_CONTROL,
                  terminate=terminate)
