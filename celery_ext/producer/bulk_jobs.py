"""``apply_many``'s direct path: each job's message built as ``apply_async`` builds it,
handed to the transport without ``send_task`` and ``Producer.publish`` per job.

A loop of ``apply_async`` inside a bulk spends most of its time before the write:
Celery's ``send_task`` (option merging, half a dozen ``app.conf`` lookups, each a
chain of dict reads) and Kombu's ``Producer.publish`` (argument shuffling, the
per-publish declaration check) run again for every job of a call whose options are
the same for all of them. :class:`Jobs` resolves once per call what is constant
(the merged options, the retry policy, the serializer, the producer and its
channel, ``origin``, the ``argsrepr`` limits, the parent task) and per job runs only
what depends on the job's arguments, in the order a single publish runs it:

1. the argument check (``task.typing``) and a new task id;
2. Celery's router, given the job's args and kwargs (about 2 µs: always called, so a
   router that reads them routes each job as ``apply_async`` would);
3. the message from Celery's own ``app.amqp.as_task_v2`` (``argsrepr`` and
   ``kwargsrepr`` as its ``saferepr`` writes them: :func:`argsrepr`);
4. the destination (queue, exchange, routing key, delivery mode) as Celery's
   ``send_task_message`` derives it, ``before_task_publish`` with Celery's arguments
   (its receivers are read once per call; when the only one is celery_ext's fair key,
   the key is computed here as that receiver computes it, without the dispatch);
5. the body serialized by Kombu's ``Producer._prepare`` and the message dict by the
   channel's ``prepare_message`` and ``basic_publish`` (body encoding, delivery tag,
   delivery info), whose ``_put`` hands the job to the Enqueuer and so to the bulk
   (publish marker, priority level, fair key, unique lock, scheduled set);
6. ``after_task_publish`` (when it has receivers), the ``AsyncResult`` (pointed at
   the pending job of a unique task once the bulk is written), the parent's trail.

The stored message is the one ``apply_async`` stores, but for its ids and timestamps
(``tests/integration/test_bulk_messages.py`` compares them field by field).

:func:`direct_path` says when this path is taken; any other call (an app or task
that overrides what is skipped here, a producer in a Kombu batch, a transport other
than ours, a cluster, eager mode, task-sent events, an option that is per job in
``apply_async``) runs the loop of ``apply_async`` inside a bulk, as before.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from datetime import datetime
from types import ModuleType
from typing import Any, cast

from celery import Celery, signals
from celery.app import amqp as celery_amqp
from celery.app import base as celery_base
from celery.app import task as celery_task
from celery.utils.nodenames import anon_nodename
from celery.utils.saferepr import saferepr
from celery.utils.time import subtract_datetimes
from dateutil.parser import isoparse
from kombu import Queue, messaging
from kombu.common import Broadcast
from kombu.utils.functional import maybe_list
from kombu.utils.uuid import uuid

from celery_ext.options import fair
from celery_ext.options import unique as _unique
from celery_ext.options.checks import check_task
from celery_ext.producer.bulk import Bulk

#: ``send_task`` options that name one job: a call with one of them publishes through
#: ``apply_async`` per job (the loop), as it always did.
PER_JOB_OPTIONS = frozenset({"task_id", "connection", "publisher", "stamped_headers",
                             "argsrepr", "kwargsrepr", "task_type"})
#: Parameters of Celery's ``send_task`` (the rest of a call's options go on to the
#: message and ``send_task_message``, as there).
_SEND_TASK = inspect.signature(Celery.send_task)
#: Named parameters of Kombu's ``Producer.publish``: Celery's message properties
#: with these names are its arguments, not properties.
_PUBLISH_NAMED = frozenset(
    name for name, p in inspect.signature(messaging.Producer.publish).parameters.items()
    if p.kind is not inspect.Parameter.VAR_KEYWORD and name not in ("self", "body"))


#: Types whose ``repr`` is what Celery's ``saferepr`` writes for them (a ``str`` too,
#: when it is printable and holds no quote or backslash: :func:`_plain`).
_SCALARS = frozenset({int, float, bool, type(None)})


def _plain(value: Any) -> bool:
    kind = type(value)
    return kind in _SCALARS or (kind is str and value.isprintable()
                                and "'" not in value and "\\" not in value)


def argsrepr(value: Any, maxsize: int, maxlevels: int) -> str:
    """Celery's ``saferepr(value, maxsize, maxlevels)``, as ``as_task_v2`` writes the
    ``argsrepr`` and ``kwargsrepr`` headers. A flat tuple, list or dict of plain values
    (:func:`_plain`) whose ``repr`` is shorter than ``maxsize`` has it as its
    ``saferepr``, in a fraction of the time; anything else goes to ``saferepr``."""
    kind = type(value)
    if kind is tuple or kind is list:
        flat = all(map(_plain, value))
    elif kind is dict:
        flat = all(map(_plain, value)) and all(map(_plain, value.values()))
    else:
        flat = False
    if flat:
        text = repr(value)
        if len(text) < maxsize:
            return text
    return cast(str, saferepr(value, maxsize, maxlevels=maxlevels))


def _wrapped_by_us(fn: Any) -> bool:
    return bool(getattr(fn, "_celery_ext_checks", False)
                or getattr(fn, "_celery_ext_unique", False))


def _unwrapped_send_task(app: Any) -> Any:
    """The function under celery_ext's own ``send_task`` wrappers (``install(app)``'s
    option checks and unique jobs)."""
    fn = app.send_task
    while _wrapped_by_us(fn):
        fn = fn.__wrapped__
    return fn


def _celerys(fn: Any, module: ModuleType) -> bool:
    """Whether ``fn`` is ``module``'s own code: not a subclass's override, nor a wrapper
    another library put in its place (an APM's ``apply_async`` that adds trace headers
    must run; a ``functools.wraps`` wrapper has its own code)."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return code is not None and code.co_filename == module.__file__


def direct_path(app: Any, task: Any, options: Mapping[str, Any], producer: Any) -> bool:
    """Whether a call of ``apply_many`` can build its jobs itself: everything it skips
    is Celery's and Kombu's own code and the channel is ours, on one node or Sentinel (a
    cluster writes each job at once)."""
    channel: Any = getattr(producer, "channel", None)
    if getattr(type(channel), "enqueuer", None) is None or channel.keys.cluster:
        return False
    amqp, conf = app.amqp, app.conf
    return (_celerys(_unwrapped_send_task(app), celery_base)
            and _celerys(task.apply_async, celery_task)
            and _celerys(task.shadow_name, celery_task)
            and not getattr(task, "__v2_compat__", False)
            and getattr(task, "_dump_pydantic_arguments", None) is None
            and _celerys(amqp.send_task_message, celery_amqp)
            and _celerys(amqp.as_task_v2, celery_amqp)
            and amqp.create_task_message == amqp.as_task_v2
            and _celerys(producer.publish, messaging)
            and _celerys(producer._prepare, messaging)
            and getattr(producer._batch_local, "current", None) is None
            and not conf.task_always_eager and not conf.task_send_sent_event
            and not signals.task_sent.receivers
            and not PER_JOB_OPTIONS.intersection(options))


class Jobs:
    """One ``apply_many`` call's constant part; :meth:`publish` adds one job to ``bulk``."""

    def __init__(self, app: Any, task: Any, options: Mapping[str, Any], producer: Any,
                 bulk: Bulk) -> None:
        if task.soft_time_limit and task.time_limit and task.soft_time_limit > task.time_limit:
            raise ValueError("soft_time_limit must be less than or equal to time_limit")
        self.app, self.task, self.producer, self.bulk = app, task, producer, bulk
        self.channel = producer.channel
        self.amqp = amqp = app.amqp
        conf = app.conf
        installed = _wrapped_by_us(app.send_task)
        if installed:
            check_task(task)  # install(app)'s option checks: the options are the call's
        # apply_async: the task's execution options under the call's; then send_task's
        # own parameters, the rest going on to the message.
        merged = dict(task._get_exec_options(), **options)
        merged.setdefault("ignore_result", task.ignore_result)
        bound = _SEND_TASK.bind(app, task.name, None, None, task_type=task,
                                result_cls=task.AsyncResult, **merged)
        bound.apply_defaults()
        a = bound.arguments
        opts: dict[str, Any] = dict(a["options"])
        self.name: str = a["name"]
        self.route_name = a["route_name"] or self.name
        self.router = a["router"] or amqp.router
        self.result_cls = a["result_cls"]
        self.add_to_parent = a["add_to_parent"]
        self.countdown, self.eta = a["countdown"], a["eta"]
        # An omitted limit or expiry takes the merged option's value; an explicit one
        # (None too) wins over it.
        limits = {key: opts.pop(key, None) if a[key] is _OMITTED else a[key]
                  for key in ("time_limit", "soft_time_limit", "expires")}
        for key in limits:
            opts.pop(key, None)
        self.expires = limits["expires"]
        self.ignore_result = opts.pop("ignore_result", None)
        root_id, parent_id = a["root_id"], a["parent_id"]
        self.parent = app.current_worker_task
        if self.parent and (not root_id or not parent_id):
            if not root_id:
                root_id = self.parent.request.root_id or self.parent.request.id
            if not parent_id:
                parent_id = self.parent.request.id
            if conf.task_inherit_parent_priority:
                opts.setdefault("priority", self.parent.request.delivery_info.get("priority"))
        self.options = opts
        self.message_args: dict[str, Any] = {
            "group_id": a["group_id"], "group_index": a["group_index"],
            "retries": a["retries"], "chord": a["chord"],
            "callbacks": maybe_list(a["link"]), "errbacks": maybe_list(a["link_error"]),
            "reply_to": a["reply_to"] or app.thread_oid, "create_sent_event": False,
            "time_limit": limits["time_limit"], "soft_time_limit": limits["soft_time_limit"],
            "root_id": root_id, "parent_id": parent_id, "shadow": a["shadow"],
            "chain": a["chain"], "replaced_task_nesting": a["replaced_task_nesting"],
            "ignore_result": self.ignore_result, "origin": anon_nodename()}
        self.repr_levels = conf.task_repr_maxlevels
        # send_task_message's defaults (Celery reads them once per app too).
        self.default_retry = conf.task_publish_retry
        self.default_policy = conf.task_publish_retry_policy
        self.default_delivery_mode = conf.task_default_delivery_mode
        self.default_exchange = amqp.default_exchange
        self.default_rkey = conf.task_default_routing_key
        self.default_serializer = conf.task_serializer
        self.default_compressor = conf.task_compression
        self.on_task_call = None if self.ignore_result else app.backend.on_task_call
        self.unique = installed and bool(getattr(task, "unique", False))
        if self.unique:
            _unique.validate_unique_options(task)
            self.unique_key = _unique._key_of(task)
        self._declared: set[int] = set()
        # The publish signals' receivers, read once per call. When the only one before
        # a publish is celery_ext's fair key (the usual case), it runs here directly.
        before = signals.before_task_publish._live_receivers(self.name)
        self.send_before = bool(before)
        self.fair_task: Any = None
        if before == [fair._on_before_publish] and not a["retries"]:
            self.send_before = False
            self.fair_task = fair._declaring_task(self.name)
        self.send_after = bool(signals.after_task_publish._live_receivers(self.name))

    def publish(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Publish one job as ``task.apply_async(args, kwargs, **options)`` would, into
        the bulk; returns its ``AsyncResult``."""
        task = self.task
        if task.typing:
            check_arguments = getattr(task, "__header__", None)
            if check_arguments is not None:
                check_arguments(*(args or ()), **(kwargs or {}))
        task_id = uuid()
        options = self.router.route(dict(self.options), self.route_name, args, kwargs, task)
        expires = self.expires
        if expires is not None:
            options["expiration"] = self._expiration(expires)
        amqp = self.amqp
        message = amqp.as_task_v2(
            task_id, self.name, args, kwargs, self.countdown, self.eta, expires=expires,
            argsrepr=argsrepr(args or (), amqp.argsrepr_maxsize, self.repr_levels),
            kwargsrepr=argsrepr(kwargs or {}, amqp.kwargsrepr_maxsize, self.repr_levels),
            **self.message_args, **options)
        if self.on_task_call is not None:
            self.on_task_call(self.producer, task_id)
        uniq = None
        if self.unique:
            uniq = _unique.UniqueRequest(
                name=self.name,
                digest=_unique.unique_digest(self.name, args, kwargs, self.unique_key),
                ttl=getattr(task, "unique_ttl", None),
                mode=_unique.unique_mode(task) or _unique.UNTIL_STARTED,
                debounce=getattr(task, "debounce", None))
        self._send(message.headers, message.properties, message.body, options, uniq)
        result = self.result_cls(task_id)
        result.ignored = self.ignore_result
        if uniq is not None and uniq.holder is None:
            uniq.result = result  # the bulk points it at the pending job when written
        if self.add_to_parent and self.parent:
            self.parent.add_trail(result)
        return result

    def _expiration(self, expires: Any) -> float:
        """Seconds until ``expires``, as ``send_task`` computes them (0 when past)."""
        if isinstance(expires, datetime):
            seconds = subtract_datetimes(expires, self.app.now()).total_seconds()
        elif isinstance(expires, str):
            seconds = subtract_datetimes(isoparse(expires), self.app.now()).total_seconds()
        else:
            seconds = expires
        return 0 if seconds < 0 else seconds

    def _send(self, headers: dict[str, Any], properties: dict[str, Any], body: Any,
              options: dict[str, Any], uniq: _unique.UniqueRequest | None) -> None:
        """Celery's ``send_task_message`` for one job (its named parameters popped from
        ``options``, the rest made properties), publishing into the bulk."""
        pop = options.pop
        exchange, routing_key, queue = pop("exchange", None), pop("routing_key", None), \
            pop("queue", None)
        pop("retry", None)  # the bulk's round trips are retried (apply_many's policy)
        retry_policy = pop("retry_policy", None)
        serializer, delivery_mode = pop("serializer", None), pop("delivery_mode", None)
        compression, declare = pop("compression", None), pop("declare", None)
        extra, exchange_type = pop("headers", None), pop("exchange_type", None)
        timeout, confirm_timeout = pop("timeout", None), pop("confirm_timeout", None)
        pop("event_dispatcher", None)
        if extra:
            headers.update(extra)
        if options:
            properties.update(options)
        qname = queue
        if queue is None and exchange is None:
            queue = self.amqp.default_queue
        if queue is not None:
            if isinstance(queue, str):
                qname, queue = queue, self.amqp.queues[queue]
            else:
                qname = queue.name
        if delivery_mode is None:
            try:
                delivery_mode = queue.exchange.delivery_mode
            except AttributeError:
                pass
            delivery_mode = delivery_mode or self.default_delivery_mode
        if exchange_type is None:
            try:
                exchange_type = queue.exchange.type
            except AttributeError:
                exchange_type = "direct"
        if (not exchange or not routing_key) and exchange_type == "direct":
            exchange, routing_key = "", qname
        elif exchange is None:
            exchange = queue.exchange.name or self.default_exchange
            routing_key = routing_key or queue.routing_key or self.default_rkey
        if declare is None and queue and not isinstance(queue, Broadcast):
            declare = [queue]
        if self.send_before:
            policy = (dict(self.default_policy, **retry_policy) if retry_policy
                      else dict(self.default_policy))
            signals.before_task_publish.send(
                sender=self.name, body=body, exchange=exchange, routing_key=routing_key,
                declare=declare, headers=headers, properties=properties, retry_policy=policy)
        elif self.fair_task is not None and properties.get(fair.PROPERTY) is None:
            key = fair.key_for(self.fair_task, body[0], body[1])  # (_on_before_publish)
            if key is not None:
                properties[fair.PROPERTY] = key
        self._publish(body, headers, properties, exchange, routing_key,
                      serializer or self.default_serializer,
                      compression or self.default_compressor, delivery_mode,
                      list(declare or ()), timeout, confirm_timeout, uniq)
        if self.send_after:
            signals.after_task_publish.send(sender=self.name, body=body, headers=headers,
                                            exchange=exchange, routing_key=routing_key)

    def _publish(self, body: Any, headers: dict[str, Any], celery_props: dict[str, Any],
                 exchange: Any, routing_key: Any, serializer: Any, compression: Any,
                 delivery_mode: Any, declare: list[Any], timeout: Any, confirm_timeout: Any,
                 uniq: _unique.UniqueRequest | None) -> None:
        """Kombu's ``Producer.publish`` and ``_publish`` for one job: without the retry
        wrapper (the bulk retries its round trips) and declaring each entity once per
        call; the channel's ``basic_publish`` hands the job to the Enqueuer, and so to
        the bulk (a unique job's request is handed over as ``send_task`` hands it)."""
        producer, channel = self.producer, self.channel
        named = {k: celery_props[k] for k in _PUBLISH_NAMED.intersection(celery_props)}
        properties = {k: v for k, v in celery_props.items() if k not in named}
        exchange_name, properties["delivery_mode"] = producer._delivery_details(
            exchange or producer.exchange, delivery_mode)
        expiration = named.get("expiration")
        if expiration is not None:
            properties["expiration"] = str(int(expiration * 1000))
        body, content_type, content_encoding = producer._prepare(
            body, serializer, named.get("content_type"), named.get("content_encoding"),
            compression, headers)
        if producer.auto_declare and producer.exchange.name \
                and producer.exchange not in declare:
            declare.append(producer.exchange)
        message = channel.prepare_message(body, named.get("priority", 0), content_type,
                                          content_encoding, headers, properties)
        for entity in declare:
            if id(entity) not in self._declared:
                producer.maybe_declare(entity)
                self._declared.add(id(entity))
        if isinstance(properties.get("reply_to"), Queue):
            properties["reply_to"] = properties["reply_to"].name
        token = _unique._pending.set(uniq) if uniq is not None else None
        try:
            channel.basic_publish(message, exchange=exchange_name, routing_key=routing_key,
                                  mandatory=named.get("mandatory", False),
                                  immediate=named.get("immediate", False), timeout=timeout,
                                  confirm_timeout=confirm_timeout, _publish_batch=self.bulk)
        finally:
            if token is not None:
                _unique._pending.reset(token)


#: ``send_task``'s marker of an omitted ``expires``, ``time_limit``, ``soft_time_limit``.
_OMITTED = _SEND_TASK.parameters["expires"].default
