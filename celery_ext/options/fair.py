"""Fair shares by key inside one job queue: one tenant's 10,000 jobs do not delay
another tenant's one.

A job's **fair key** is the message property ``fair_key``. The producer sets it:

- from the task option ``fair_by``, a function called with the task's arguments as
  the task gets them (``@app.task(fair_by=lambda report_id, *, tenant: tenant)``),
  when the job is published (Celery's ``before_task_publish`` signal, in the
  producer process, which has the task registered: drop-in mode included);
- or per call: ``apply_async(..., fair_key="t1")`` (Celery passes unknown options on
  as message properties), which wins over ``fair_by``.

A retry (``Task.retry``) keeps the key: ``fair_by`` gets the same arguments, and a
per-call key is read back from the request being retried. The key is a string; one
that is empty, longer than :data:`MAX_KEY` or holds anything but printable ASCII
other than ``"`` and ``\\`` is replaced by ``#`` and a hash of it (so the scripts
find it in the payload without a JSON parser); ``fair_by`` returning None gives no
key. A ``fair_by`` that raises is logged in one line and the job is enqueued without
a key (it runs, as an unkeyed job of its queue).

The producer (:class:`celery_ext.producer.Enqueuer`) writes ``fair_key`` as the
message's last property, and a keyed job goes to its key's **sub-queue**
(``Keys.fair_queue``) instead of a priority level list; a sub-queue that was empty
puts its key in the queue's **ring** of active keys (``Keys.fair_ring``). Fetch serves
a queue's unkeyed jobs first, then one keyed job per key in ring order, rotating the
ring (``fetch.lua``). Every later move reads the key from the payload in the script
(``store/lua/include/fair.lua``), so a job always goes back to its own sub-queue.

Per-key concurrency: the task option ``fair_max_concurrency=N`` caps the jobs of one
key in flight in all pools (needs ``acks_late``, as ``max_concurrency``). Worker
pools write it at start into ``{ns}:limits`` as the field ``"<queue>\\n"``; the jobs
of each key in flight are counted in ``{ns}:running`` as ``"<queue>\\n<key>"``, with a
limit or not, so that a limit written while a key's jobs run counts them (docs/fair.md).

Per-key rate limit: the task option ``fair_rate_limit="5/s"`` (Celery's rate syntax, the
range of ``rate_limit``: :mod:`celery_ext.options.rate_limits`) spaces the jobs of one key
in all pools, GCRA on the Redis clock in the fetch. Worker pools write it at start into
``{ns}:rate_limits`` as the field ``"<queue>\n"`` (µs between two jobs of a key); each
key's "not due until" time is the string ``Keys.fair_due`` (expiring when due), which a
job raising ``celery_ext.Throttled`` in a keyed job sets too (one state for both).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any, TypedDict

from celery import current_task, signals
from celery._state import _get_active_apps, get_current_app
from kombu.utils.encoding import bytes_to_str

from celery_ext.options.limits import job_limits, write_limits
from celery_ext.options.rate_limits import format_rate, task_interval
from celery_ext.options.routing import any_task_declares, task_queues
from celery_ext.store.compact import unpack
from celery_ext.store.keys import Keys
from celery_ext.text import one_line

logger = logging.getLogger("celery_ext.options.fair")

#: The message property holding a job's fair key.
PROPERTY = "fair_key"
#: Longest fair key kept as it is; a longer one is replaced by its hash.
MAX_KEY = 128
#: Biggest keys a reader lists per fair queue.
TOP_KEYS = 5
_SAFE = re.compile(r"[\x20-\x7e]+")


class FairInfo(TypedDict):
    """A job queue's fair keys with jobs waiting, for the dashboard and the CLI."""

    #: Keys whose sub-queue holds jobs (the ring's length).
    active_keys: int
    #: Up to TOP_KEYS (key, jobs waiting), the most jobs first.
    top_keys: list[tuple[str, int]]
    #: The queue's per-key rate limit (``fair_rate_limit``, e.g. "5/s"), or None.
    rate_limit: str | None
    #: Up to TOP_KEYS (key, seconds until its next job is due) of the active keys not
    #: due yet (a per-key rate limit, or a hold a job asked for: ``Throttled``), the
    #: longest wait first.
    not_due: list[tuple[str, float]]


def clean_key(value: Any) -> str | None:
    """The fair key as stored: ``str(value)``, or ``#<hash>`` when it is empty, too
    long or holds a character the scripts cannot find unescaped; None stays None."""
    if value is None:
        return None
    key = value if isinstance(value, str) else str(value)
    if len(key) <= MAX_KEY and _SAFE.fullmatch(key) and '"' not in key and "\\" not in key:
        return key
    return "#" + hashlib.blake2b(key.encode("utf-8", "replace"), digest_size=12).hexdigest()


def message_fair_key(message: Mapping[str, Any]) -> str | None:
    """The fair key of a Kombu message dict, or None."""
    props = message.get("properties")
    return clean_key(props.get(PROPERTY)) if isinstance(props, Mapping) else None


def payload_fair_key(payload: bytes | str) -> str | None:
    """The fair key of a stored payload, or None (also when it cannot be read)."""
    try:
        message = unpack(bytes_to_str(payload), "")  # (nor does the key on the queue)
    except Exception:
        return None
    return message_fair_key(message) if isinstance(message, Mapping) else None


def place_last(props: dict[str, Any]) -> str | None:
    """Clean the message's fair key and move it to the end of its properties, where
    the scripts look for it (``include/fair.lua``). Returns it (None: no key)."""
    key = clean_key(props.pop(PROPERTY, None))
    if key is not None:
        props[PROPERTY] = key
    return key


def _fair_by(task: Any) -> Any:
    func = getattr(task, "fair_by", None)
    # A function given as a task option becomes a method of the task class.
    if inspect.ismethod(func) and func.__self__ is task:
        return func.__func__
    return func


def key_for(task: Any, args: Any, kwargs: Any) -> str | None:
    """The fair key ``task``'s ``fair_by`` gives for these arguments (None: no
    ``fair_by``, it returned None, or it raised, which is logged)."""
    func = _fair_by(task)
    if func is None:
        return None
    try:
        return clean_key(func(*(args or ()), **(kwargs or {})))
    except Exception as exc:
        logger.warning("celery_ext: fair_by of %s raised %s: %s; the job is enqueued "
                       "without a fair key", one_line(task.name), type(exc).__name__,
                       one_line(str(exc)))
        return None


def _args_of(body: Any) -> tuple[Any, Any]:
    """(args, kwargs) of a task message body: protocol 2's tuple or protocol 1's dict."""
    if isinstance(body, (tuple, list)) and len(body) >= 2:
        return body[0], body[1]
    if isinstance(body, Mapping):
        return body.get("args"), body.get("kwargs")
    return (), {}


def _declaring_task(name: str) -> Any:
    """The task named ``name`` that declares ``fair_by``, in the current app or else in
    any other app of this process: the signal does not say which app publishes, and the
    current app is not always the publisher (several apps in one process, or apps made
    with ``set_as_current=False``). Registries are read as they are (``.tasks`` would
    finalize an app that may not want it)."""
    current = get_current_app()
    task = current._tasks.get(name)
    if task is not None and getattr(task, "fair_by", None) is not None:
        return task
    others = _get_active_apps()
    if not others or (len(others) == 1 and current in others):  # one app: looked already
        return None
    for app in others:
        task = app._tasks.get(name)
        if task is not None and getattr(task, "fair_by", None) is not None:
            return task
    return None


def _on_before_publish(sender: Any = None, body: Any = None, headers: Any = None,
                       properties: Any = None, **_: Any) -> None:
    """Set the ``fair_key`` property of a job about to be published (module docstring)."""
    if not isinstance(properties, dict) or properties.get(PROPERTY) is not None:
        return
    task = _declaring_task(sender) if sender else None
    if task is not None:
        key = key_for(task, *_args_of(body))
    else:
        # A retry of a job given its key per call: the request being retried has it.
        # (Celery's retry counts up the retries header; a first publish has none.)
        if not isinstance(headers, dict) or not headers.get("retries"):
            return
        request = getattr(current_task, "request", None)
        req_props = getattr(request, "properties", None)
        if not isinstance(req_props, dict) or getattr(request, "id", None) != headers.get("id"):
            return
        key = clean_key(req_props.get(PROPERTY))
    if key is not None:
        properties[PROPERTY] = key


def connect() -> None:
    """Compute fair keys in this process's publishes (idempotent; the transport module
    calls it when it is imported, i.e. before its first publish)."""
    signals.before_task_publish.connect(_on_before_publish, weak=False,
                                        dispatch_uid="celery_ext.options.fair")


def job_fair_limits(app: Any) -> dict[str, int]:
    """Job queue -> fair_max_concurrency for every registered task that declares one
    (tasks sharing a queue: the smallest)."""
    return job_limits(app, "fair_max_concurrency")


def write_fair_limits(client: Any, keys: Keys, limits: Mapping[str, int],
                      consumed: Iterable[str]) -> list[str]:
    """Set the per-key limits of the consumed queues (fields ``"<queue>\n"`` of
    ``{ns}:limits``), removing undeclared ones, and wake pools for each change.
    Returns the queues whose per-key limit changed."""
    return write_limits(client, keys, limits, consumed, suffix="\n")


def job_fair_rates(app: Any) -> dict[str, int]:
    """Job queue -> µs between two jobs of one fair key (``fair_rate_limit``) for every
    registered task that declares one (tasks sharing a queue: the strictest, the
    longest interval). ValueError naming the task for a value that is not a rate."""
    if not any_task_declares(app, "fair_rate_limit", truthy=True):
        return {}
    queues = task_queues(app)
    rates: dict[str, int] = {}
    for name, task in sorted(app.tasks.items()):
        interval = task_interval(task, "fair_rate_limit")
        if interval is not None:
            rates[queues[name]] = max(interval, rates.get(queues[name], interval))
    return rates


def write_fair_rates(client: Any, keys: Keys, rates: Mapping[str, int],
                     consumed: Iterable[str]) -> list[str]:
    """Set the per-key rate limits of the consumed queues (fields ``"<queue>\n"`` of
    ``{ns}:rate_limits``), removing undeclared ones, and wake pools for each change.
    Each key's state is kept: it expires by itself within one old interval."""
    return write_limits(client, keys, rates, consumed, hash_name="rate_limits", suffix="\n")


def fair_info(client: Any, keys: Keys, queues: list[str],
              top: int = TOP_KEYS) -> dict[str, FairInfo]:
    """The fair keys with jobs of each queue that has any, its per-key rate limit and
    the keys not due yet (a reader's view: one LLEN and one PTTL per active key, two
    round trips in all)."""
    with client.pipeline(transaction=False) as pipe:
        for queue in queues:
            pipe.lrange(keys.of(queue).fair_ring(queue), 0, -1)  # (a cluster: its copy)
        rings = [[bytes_to_str(k) for k in ring] for ring in pipe.execute()]
    with client.pipeline(transaction=False) as pipe:
        for queue, ring in zip(queues, rings, strict=True):
            if ring:
                copy = keys.of(queue)
                pipe.hget(copy.rate_limits, queue + "\n")
                for key in ring:
                    pipe.llen(copy.fair_queue(queue, key))
                    pipe.pttl(copy.fair_due(queue, key))
        replies = iter(pipe.execute())
    out: dict[str, FairInfo] = {}
    for queue, ring in zip(queues, rings, strict=True):
        if ring:
            rate = next(replies)
            sizes, due = [], []
            for key in ring:
                sizes.append((key, int(next(replies))))
                ms = int(next(replies))
                if ms > 0:  # (-2: no state, the key is due)
                    due.append((key, ms / 1000))
            sizes.sort(key=lambda kv: (-kv[1], kv[0]))
            due.sort(key=lambda kv: (-kv[1], kv[0]))
            out[queue] = FairInfo(
                active_keys=len(ring), top_keys=sizes[:top],
                rate_limit=format_rate(int(rate)) if rate is not None else None,
                not_due=due[:top])
    return out


def split_running(fields: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``{ns}:running`` (or ``{ns}:limits``) hash split into its per-queue fields
    and its per-fair-key fields (those with a newline)."""
    queues = {k: v for k, v in fields.items() if "\n" not in k}
    return queues, {k: v for k, v in fields.items() if "\n" in k}
