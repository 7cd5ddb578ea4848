"""The result backend: ``result_backend = "celery-ext://host:port/db"``.

A Celery key/value backend (``BaseKeyValueStoreBackend``, as Celery's Redis backend) on the
plugin's connection layer, so it speaks to one node, Sentinel or a cluster with the
broker's URL forms and options (``result_backend_transport_options``; see
``connection.py``). What it changes from Celery's Redis backend:

- every key is built in ``store/keys.py`` (``ResultKeys``) and tagged by its task id (a
  result) or group id (a group, a chord), so results spread over a cluster's masters;
- every key has a TTL: a ``result_expires`` of None or 0 means Celery's default, one day
  (``DEFAULT_RESULT_EXPIRES``), not "forever" (celery/celery#7801);
- a waiting client holds one subscription, not one per result (``consumer.py``);
- a chord counts its header results by task id in one script (``chords.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from celery import states
from celery.backends.asynchronous import AsyncBackendMixin
from celery.backends.base import BaseKeyValueStoreBackend
from celery.exceptions import BackendError, BackendStoreError
from kombu.utils.objects import cached_property
from redis.cluster import RedisCluster

from celery_ext.config import (
    DEFAULT_RESULT_EXPIRES,
    SCHEME,
    TLS_SCHEME,
    ConfigError,
    Settings,
    mask_url,
)
from celery_ext.errors import CONNECTION_ERRORS, NotReplicated
from celery_ext.results.chords import ChordCounting
from celery_ext.results.connection import results_client
from celery_ext.results.consumer import WakeupConsumer
from celery_ext.results.dead_jobs import DeadJobResults
from celery_ext.store.connections import CLUSTER_NO_WAIT
from celery_ext.store.dead_set import on_dead
from celery_ext.store.keys import ResultKeys

#: Redis's largest string (512 MB): a bigger result is refused before it is sent.
MAX_VALUE_BYTES = 512 * 1024 * 1024


class ResultBackend(ChordCounting, BaseKeyValueStoreBackend, AsyncBackendMixin):
    """Celery's result API on Redis/Valkey, one node, Sentinel or cluster."""

    ResultConsumer = WakeupConsumer
    #: The URL scheme this class is registered for; Celery hands a
    #: ``celery-ext+sentinel://`` URL over without the part before the ``+``.
    scheme = SCHEME

    #: One instance serves every greenlet of a ``-P gevent`` worker (``worker/green.py``).
    shared_by_greenlets = True
    supports_autoexpire = True
    supports_native_join = True
    supports_failure_expires = True
    #: Chords are counted by ``chords.py``, not by the base class's INCR.
    implements_incr = False

    def __init__(self, url: str | None = None, **kwargs: Any) -> None:
        super().__init__(expires_type=int, url=url, **kwargs)
        conf = self.app.conf
        self.url = self._full_url(url or conf.result_backend or "")
        self.options: dict[str, Any] = dict(conf.get("result_backend_transport_options") or {})
        self.settings = Settings.load(
            {k: v for k, v in self.options.items() if k in Settings.option_names()})
        self.keys = ResultKeys(self.settings.namespace, self.settings.global_keyprefix)
        self.expires: int = int(self.expires or DEFAULT_RESULT_EXPIRES)
        failure = conf.get("result_failure_expires")
        self.failure_expires = (self.expires if failure is None
                                else self.prepare_expires(failure, type=int) or self.expires)
        from kombu.transport.redis import get_redis_error_classes

        connection_errors, self.channel_errors = get_redis_error_classes()
        # A cluster failing over answers CLUSTERDOWN/TRYAGAIN for a moment: a lost
        # connection too, to the waiting client's re-read and to always_retry.
        self.connection_errors = (*connection_errors, *CONNECTION_ERRORS)
        self.result_consumer = self.ResultConsumer(
            self, self.app, self.accept, self._pending_results, self._pending_messages)
        if self.cluster and self.settings.wait_replicas:  # (bad URLs fail here, in one line)
            raise ConfigError(CLUSTER_NO_WAIT)
        #: Set while this thread's stores are tried once (:meth:`single_try`).
        self._single_try = threading.local()
        on_dead(DeadJobResults(self.app))  # jobs the dead set takes in fail their results

    @contextmanager
    def single_try(self) -> Iterator[None]:
        """Stores made in this block (this thread's) are tried once: a store that fails
        on a lost connection raises instead of waiting for Celery's next try
        (``result_backend_always_retry``, up to ``result_backend_max_retries``: forever by
        default). The dead set's listener stores from the reaper's thread and the
        fetch's, which must not stop while a result backend is away."""
        self._single_try.on = True
        try:
            yield
        finally:
            self._single_try.on = False

    def _sleep(self, amount: float) -> None:
        """Celery's wait before it tries a store again (see :meth:`single_try`)."""
        if getattr(self._single_try, "on", False):
            raise BackendError("celery_ext: the result backend did not answer (not tried "
                               "again from this thread)")
        super()._sleep(amount)

    def _full_url(self, url: str) -> str:
        if url.startswith("sentinel://"):
            return f"{self.scheme}+{url}"
        if "://" not in url:
            raise ConfigError(f"celery_ext: result backend URL {mask_url(url)!r} names no "
                              f"server (e.g. {SCHEME}://localhost:6379/1)")
        return url

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        """A lost connection (a failover, a restart) is retried by Celery's
        ``result_backend_always_retry``, as with Celery's Redis backend."""
        return isinstance(exc, self.connection_errors)

    @cached_property
    def client(self) -> Any:
        return results_client(self.url, self.options, self.settings)

    @property
    def cluster(self) -> bool:
        return isinstance(self.client, RedisCluster)

    def as_uri(self, include_password: bool = False) -> str:
        return self.url if include_password else mask_url(self.url)

    def __reduce__(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                   ) -> Any:
        return super().__reduce__(args, dict(kwargs or {}, expires=self.expires, url=self.url))

    # -- keys -------------------------------------------------------------------------

    def get_key_for_task(self, task_id: Any, key: str = "") -> str:
        if not task_id:
            raise ValueError(f"task_id must not be empty. Got {task_id} instead.")
        return self.keys.result(str(task_id)) + key

    def get_key_for_group(self, group_id: Any, key: str = "") -> str:
        if not group_id:
            raise ValueError(f"group_id must not be empty. Got {group_id} instead.")
        return self.keys.group(str(group_id)) + key

    def get_key_for_chord(self, group_id: Any, key: str = "") -> str:
        if not group_id:
            raise ValueError(f"group_id must not be empty. Got {group_id} instead.")
        return self.keys.chord(str(group_id)) + key

    # -- the key/value operations Celery's base class builds on -----------------------

    def get(self, key: str) -> Any:
        return self.client.get(key)

    def mget(self, keys: Sequence[str]) -> list[Any]:
        if not keys:
            return []
        if self.cluster:  # keys of many slots: one MGET per slot, in one pass
            return list(self.client.mget_nonatomic(list(keys)))
        return list(self.client.mget(list(keys)))

    def set(self, key: str, value: Any, expires: int | None = None) -> None:
        self._check_size(value)
        self.client.set(key, value, ex=int(expires or self.expires))

    def _set_with_state(self, key: str, value: Any, state: str) -> None:
        self.set(key, value, self.failure_expires if state == states.FAILURE else None)

    def delete(self, key: str) -> None:
        self.client.delete(key)

    def expire(self, key: str, value: Any) -> None:
        self.client.expire(key, int(value or self.expires))

    def _check_size(self, value: Any) -> None:
        if isinstance(value, str | bytes) and len(value) > MAX_VALUE_BYTES:
            raise BackendStoreError("value too large for the celery-ext result backend")

    # -- storing and waiting ------------------------------------------------------------

    def _store_result(self, task_id: str, result: Any, state: str, traceback: Any = None,
                      request: Any = None, **kwargs: Any) -> Any:
        """Celery's store (a SUCCESS already stored is kept, as Celery does against a
        duplicate run) with its TTL, then the wake-up: the meta published to the channel of
        the client that sent the task (its ``reply_to``), if it named one. With
        ``wait_replicas`` the write is confirmed by that many replicas (``WAIT``, one node
        or Sentinel) or ``NotReplicated`` says it is not."""
        meta = self._get_result_meta(result=result, state=state, traceback=traceback,
                                     request=request)
        meta["task_id"] = str(task_id)
        if self._get_task_meta_for(task_id)["status"] == states.SUCCESS:
            return result
        encoded = self.encode(meta)
        try:
            self._check_size(encoded)
        except BackendStoreError as exc:
            raise BackendStoreError(str(exc), state=state, task_id=task_id) from exc
        key = self.get_key_for_task(task_id)
        ttl = int(self.failure_expires if state == states.FAILURE else self.expires)
        reply_to = getattr(request, "reply_to", None) if request is not None else None
        channel = self.keys.wake_channel(str(reply_to)) if reply_to else None
        if self.cluster:  # the result and the channel live on different shards
            self.client.set(key, encoded, ex=ttl)
            if channel:
                self.client.spublish(channel, encoded)
            return result
        wanted = self.settings.wait_replicas
        with self.client.pipeline(transaction=False) as pipe:  # one round trip
            pipe.set(key, encoded, ex=ttl)
            if wanted:  # on the connection that wrote it, as WAIT requires
                pipe.execute_command("WAIT", wanted, self.settings.wait_timeout_ms)
            if channel:
                pipe.publish(channel, encoded)
            replies = pipe.execute()
        if wanted and int(replies[1]) < wanted:
            raise NotReplicated(f"the result of {task_id}", wanted, int(replies[1]),
                                self.settings.wait_timeout_ms)
        return result

    # No on_task_call: Celery's Redis backend subscribes there, when the task is sent, so a
    # result nobody waits for holds a subscription until the process ends (#3808). Here a
    # thread subscribes when it starts waiting (``WakeupConsumer.on_wait_for_pending``).

    def forget(self, task_id: str) -> None:
        super().forget(task_id)
        self.result_consumer.cancel_for(task_id)


class TLSResultBackend(ResultBackend):
    """The same over TLS (``celery-exts://``)."""

    scheme = TLS_SCHEME
