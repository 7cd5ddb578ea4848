"""Flower support: its broker page and ``/api/queues/length`` for ``celery-ext://``.

Flower picks its broker code by URL scheme (amqp, redis, rediss, ...) and answers
404 for any other. :func:`enable` teaches it ours: :class:`CeleryExtBroker` reads each
job queue's true length from our keys (``Keys.queue(name)``), its in-flight count and
the live pools consuming it. Nothing patches Flower unless asked: ``import celery_ext``
leaves it alone, and the Flower process asks with one line of its config file
(Flower reads ``flowerconfig.py`` from its working directory, or ``--conf=PATH``)::

    from celery_ext.admin.flower import enable; enable()

If Flower is not loaded yet when :func:`enable` runs, the patch is applied as its broker
module loads. Nothing here imports Flower.

Checkin progress: ``task.checkin()`` emits a ``task-progress`` event. Left alone,
Celery's event state turns it into a custom state ``PROGRESS`` (the task no longer
looks started) and Flower shows neither the progress nor the message, since it lists
only ``Task._fields``. :func:`show_progress_fields` keeps the task STARTED and adds
``progress`` and ``checkin`` (the message) to its fields, so Flower's task page and
``/api/task/info/<id>`` show them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any
from urllib.parse import unquote, urlparse

from celery_ext.config import OUR_SCHEMES, TLS_SCHEME, TLS_SENTINEL_SCHEME, Settings
from celery_ext.store.connections import aclose_async_client, async_client_from_url
from celery_ext.store.keys import Keys
from celery_ext.store.liveness import QUEUES_FIELDS, queues_of

logger = logging.getLogger("celery_ext.admin.flower")

SCHEMES = OUR_SCHEMES
_BROKER_MODULE = "flower.utils.broker"
_PATCHED = "_celery_ext_patched"


def _broker_class(base: type) -> type:
    """Build the shim on Flower's own ``BrokerBase`` (known only once Flower is loaded)."""

    class CeleryExtBroker(base):
        """Queue lengths of celery-ext job queues for Flower."""

        def __init__(self, broker_url: str, *args: Any, **kwargs: Any) -> None:
            super().__init__(broker_url)
            options = kwargs.get("broker_options") or {}
            self.settings = Settings.load(options)
            self.keys = Keys.for_settings(self.settings)
            parts = urlparse(broker_url)
            db = (parts.path or "/0").lstrip("/") or "0"
            params: dict[str, Any] = {
                "host": parts.hostname or "localhost",
                "port": parts.port or 6379,
                "db": int(db) if db.isdigit() else 0,
                "username": unquote(parts.username) if parts.username else None,
                "password": unquote(parts.password) if parts.password else None,
                "socket_connect_timeout": options.get("socket_connect_timeout", 1.0),
                "socket_timeout": options.get("socket_timeout", 2.0),
            }
            use_ssl = kwargs.get("broker_use_ssl")
            if parts.scheme in (TLS_SCHEME, TLS_SENTINEL_SCHEME) or use_ssl:
                params["ssl"] = True
                if isinstance(use_ssl, dict):
                    params.update(use_ssl)
            # Through the sentinels for a sentinel URL (Flower passes only the first).
            self.redis = async_client_from_url(broker_url, options, **params)

        async def queues(self, names: Sequence[str]) -> list[dict[str, Any]]:
            names = list(names)
            k = self.keys
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    steps = self.settings.priority_steps
                    for name in names:
                        for key in k.of(name).queue_levels(name, steps):
                            pipe.llen(key)
                    if k.cluster:  # each queue's count is in its own copy
                        for name in names:
                            pipe.hget(k.of(name).running, name)
                    else:
                        pipe.hmget(k.running, names or ["-"])
                    pipe.zrange(k.pools, 0, -1)
                    *replies, pool_ids = await pipe.execute()
                    nlevels = len(names) * len(steps)
                    levels = replies[:nlevels]
                    running = replies[nlevels:] if k.cluster else replies[nlevels]
                nlev = len(steps)
                lengths = [sum(levels[i:i + nlev]) for i in range(0, len(levels), nlev)]
                consumers: dict[str, int] = {}
                if pool_ids:
                    async with self.redis.pipeline(transaction=False) as pipe:
                        for pool_id in pool_ids:
                            pipe.hmget(k.pool(pool_id.decode()), QUEUES_FIELDS)
                        for raw in await pipe.execute():
                            for q in queues_of(dict(zip(QUEUES_FIELDS, raw, strict=True))) or []:
                                consumers[q] = consumers.get(q, 0) + 1
                result = []
                for name, ready, in_flight in zip(names, lengths, running, strict=False):
                    unacked = max(0, int(in_flight or 0))
                    result.append({
                        "name": name,
                        "messages": int(ready) + unacked,
                        "messages_ready": int(ready),
                        "messages_unacknowledged": unacked,
                        "consumers": consumers.get(name, 0),
                    })
                return result
            finally:
                await aclose_async_client(self.redis)

    return CeleryExtBroker


def patch_broker_module(module: ModuleType) -> None:
    """Make ``module.Broker`` (Flower's factory) answer our schemes with the shim."""
    factory = module.Broker
    if getattr(factory, _PATCHED, False):
        return
    shim = _broker_class(module.BrokerBase)
    original_new = factory.__new__

    def __new__(cls: type, broker_url: str, *args: Any, **kwargs: Any) -> Any:
        if urlparse(broker_url).scheme in SCHEMES:
            return shim(broker_url, *args, **kwargs)
        return original_new(cls, broker_url, *args, **kwargs)

    factory.__new__ = staticmethod(__new__)
    setattr(factory, _PATCHED, True)
    module.__dict__["CeleryExtBroker"] = shim


def show_progress_fields() -> None:
    """Let Flower show checkin progress: a ``task-progress`` event sets the task's
    ``progress`` and ``checkin`` (its message) and leaves its state (STARTED) alone;
    both fields join ``Task._fields``, which Flower's task page and API list."""
    from celery import states
    from celery.events.state import Task

    if "progress" in Task._fields:
        return
    Task._fields = (*Task._fields, "progress", "checkin")
    Task.progress = None  # a default, so as_dict() works for tasks that never checked in
    Task.checkin = None
    original_event = Task.event

    def event(self: Any, type_: str, timestamp: float | None = None,
              local_received: float | None = None, fields: dict[str, Any] | None = None,
              **kwargs: Any) -> None:
        if type_ != "progress":
            return original_event(self, type_, timestamp, local_received, fields, **kwargs)
        fields = fields or {}
        self.progress = fields.get("progress")
        self.checkin = fields.get("message")
        if self.state in (states.PENDING, states.RECEIVED):  # it runs: missed its start
            self.state = states.STARTED
            self.started = self.started or timestamp
            self.timestamp = timestamp
        return None

    Task.event = event


def _on_flower_loaded(module: ModuleType) -> None:
    try:
        patch_broker_module(module)
        show_progress_fields()
    except Exception:  # never break Flower because of us
        logger.exception("celery_ext: could not add celery-ext:// support to Flower")


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies the patch right after Flower's broker module is first imported."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _BROKER_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            _on_flower_loaded(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def enable() -> None:
    """Give Flower our broker page, queue lengths and checkin progress: now if Flower is
    loaded (as it is when its config file runs), else as soon as it is. Idempotent."""
    module = sys.modules.get(_BROKER_MODULE)
    if module is not None:
        _on_flower_loaded(module)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
