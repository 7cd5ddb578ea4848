"""Worker-pool registration and the heartbeat thread.

A *worker pool* is one consuming process (one ``celery worker`` main process). It
must be registered before its first fetch (the fetch script refuses otherwise), and
stamps ``{ns}:pools`` with Redis server time every ``heartbeat_interval`` from a
dedicated thread, so a long job, a busy event loop or a slow fetch never makes a live
pool look dead. A pool that finds it was reaped (SIGSTOP, network cut) re-registers.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

import redis

from celery_ext.config import Settings
from celery_ext.store.keys import Keys
from celery_ext.store.liveness import registration_fields
from celery_ext.store.scripts import Scripts
from celery_ext.worker.background import BackgroundLoop

logger = logging.getLogger("celery_ext.worker.heartbeater")

_pool_id: str | None = None
#: In a forked child (a prefork pool process): the pool id of the parent that owns
#: the jobs this child runs.
_parent_pool_id: str | None = None
_lock = threading.Lock()


def current_pool_id() -> str:
    """This process's pool id: host, pid and a random part (pids are reused)."""
    global _pool_id
    with _lock:
        if _pool_id is None:
            _pool_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        return _pool_id


def owning_pool_id() -> str:
    """The pool that owns jobs run in this process: the parent's in a prefork child."""
    return _parent_pool_id or current_pool_id()


def _reset_after_fork() -> None:
    global _pool_id, _parent_pool_id, _lock
    _parent_pool_id = _pool_id or _parent_pool_id
    _pool_id = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


class Heartbeater(BackgroundLoop):
    """Registers one pool and keeps its heartbeat fresh (``start()``/``stop()``,
    ``heartbeat()`` is the one-shot step tests call)."""

    thread_name = "celery_ext-heartbeat"

    def __init__(self, client: redis.Redis, settings: Settings, pool_id: str,
                 info: dict[str, Any] | None = None) -> None:
        self.client = client
        self.settings = settings
        self.keys = Keys.for_settings(settings)
        self.pool_id = pool_id
        self.info: dict[str, Any] = {
            "pool_id": pool_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            **registration_fields(settings),  # its own dead_after, for whoever judges it
            **(info or {}),
        }
        self.scripts = Scripts(client)
        self.registered = False
        self.reregistrations = 0
        BackgroundLoop.__init__(self)
        self._failing = False
        #: Called after the pool found it had been reaped and registered again.
        self.on_reregistered: list[Callable[[], None]] = []

    def _call(self, mode: str, info: dict[str, Any] | None = None) -> tuple[int, int]:
        fields: list[Any] = []
        for key, value in (self.info if mode == "register" else info or {}).items():
            fields += [key, value if isinstance(value, str | int | float) else repr(value)]
        ok, now = self.scripts(
            "heartbeat", [self.keys.pools, self.keys.pool(self.pool_id)],
            [self.pool_id, mode, *fields],
        )
        return int(ok), int(now)

    def register(self) -> None:
        """Register (or re-register) the pool, stamped with Redis time."""
        self._call("register")
        self.registered = True

    def update_info(self, **info: Any) -> None:
        """Add registration fields (node name, concurrency, ...) and re-register."""
        self.info = {**self.info, **info}  # a new dict: the heartbeat thread may register
        if self.registered:
            self.register()

    def set_info(self, **info: Any) -> None:
        """Change registration fields of the registered pool in place (the job queues it
        consumes): its other fields, such as "stopping", are kept. A pool found declared
        dead registers again, with them."""
        self.info = {**self.info, **info}
        if self.registered and not self._call("beat", info)[0]:
            self.revive()

    def heartbeat(self) -> bool:
        """Stamp the heartbeat once. Returns False if the pool had been declared dead
        (its jobs were requeued by a reaper); it is then registered again."""
        ok, _ = self._call("beat")
        if ok:
            return True
        self.revive()
        return False

    def revive(self) -> None:
        """The pool was found declared dead (by a heartbeat or a fetch): say so once and
        register again."""
        self.reregistrations += 1
        logger.warning(
            "celery_ext: worker pool %s was declared dead (no heartbeat for %.0fs); "
            "its in-flight jobs were requeued. Registering again.",
            self.pool_id, self.settings.dead_after,
        )
        self.register()
        for callback in self.on_reregistered:
            callback()

    def _run(self) -> None:
        interval = self.settings.heartbeat_interval
        while not self._stop.wait(interval):
            try:
                self.heartbeat()
                if self._failing:
                    logger.info("celery_ext: heartbeat to Redis restored")
                    self._failing = False
            except redis.RedisError as exc:
                if not self._failing:
                    logger.error("celery_ext: heartbeat failed: %s (will retry)", exc)
                    self._failing = True

    def start(self) -> None:
        if self._thread is not None:
            return
        self.register()
        super().start()

    def stop(self, deregister: bool = True) -> None:
        """Stop the thread; deregister unless the pool should look dead (tests)."""
        self.stop_loop()
        if deregister and self.registered:
            try:
                left = self.scripts(
                    "deregister",
                    [self.keys.pools, self.keys.pool(self.pool_id),
                     self.keys.inflight(self.pool_id), self.keys.inflight_pools],
                    [self.pool_id],
                )
                if left:
                    logger.warning(
                        "celery_ext: pool %s left with %d in-flight jobs; "
                        "the reaper will requeue them", self.pool_id, left)
            except redis.RedisError as exc:
                logger.error("celery_ext: could not deregister pool %s: %s", self.pool_id, exc)
            self.registered = False
