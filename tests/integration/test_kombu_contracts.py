"""Kombu's own contracts, tried through Kombu's API on the celery-ext:// transport (issue 33
item 4): the ``global_keyprefix`` transport option, one event per ``drain_events`` call,
and a connection on an event loop that leaves nothing on it once closed.

Real server, real ``celery worker`` for the Celery app; Kombu's ``Connection``,
``SimpleQueue``, ``Consumer`` and ``Hub`` as a Kombu user calls them.
"""

from __future__ import annotations

import json
import socket
import uuid
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue
from kombu.asynchronous import Hub

from celery_ext.admin.client import Client
from celery_ext.config import ConfigError
from celery_ext.store.keys import Keys
from celery_ext.testing.server import ClusterGroup, RedisServer
from tests.apps.proj_keyprefix import make_app
from tests.helpers import Factory, celery_cli, wait_for

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

TASK = "keyprefix.record"


def keys_of(client: redis.Redis) -> list[str]:
    return sorted(k.decode() for k in client.scan_iter(count=1000))


def prefixed(prefix: str) -> dict[str, Any]:
    return {"global_keyprefix": prefix}


# -- global_keyprefix ------------------------------------------------------------------------


def test_simple_queue_requeue_delivers_again_under_a_global_keyprefix(
        broker_url: str, redis_client: redis.Redis) -> None:
    """Kombu's SimpleQueue: put, get, requeue, get delivers the message again (it was lost
    in a half-prefixed in-flight record), and every key the round wrote carries the prefix."""
    with Connection(broker_url, transport_options=prefixed("app1:")) as conn:
        queue = conn.SimpleQueue("kp.simple")
        queue.put({"n": 1})
        first = queue.get(timeout=5)
        assert first.payload == {"n": 1}
        first.requeue()
        again = queue.get(timeout=5)
        assert again.payload == {"n": 1}
        again.ack()
        queue.close()
    keys = keys_of(redis_client)
    assert keys and all(k.startswith("app1:") for k in keys), keys
    k = Keys("celery_ext", keyprefix="app1:")
    assert redis_client.llen(k.queue("kp.simple")) == 0
    assert not any(redis_client.hlen(key) for key in keys if ":inflight:" in key)


def test_two_keyprefixes_on_one_server_keep_their_jobs_apart(
        broker_url: str, redis_client: redis.Redis) -> None:
    """Two apps, one server, one queue name: each prefix is a namespace of its own."""
    with Connection(broker_url, transport_options=prefixed("app1:")) as one, \
            Connection(broker_url, transport_options=prefixed("app2:")) as two:
        q1, q2 = one.SimpleQueue("kp.shared"), two.SimpleQueue("kp.shared")
        q1.put("for app1")
        q2.put("for app2")
        assert q1.qsize() == 1 and q2.qsize() == 1
        got1, got2 = q1.get(timeout=5), q2.get(timeout=5)
        assert (got1.payload, got2.payload) == ("for app1", "for app2")
        got1.ack()
        got2.ack()
        with pytest.raises(q1.Empty):
            q1.get(timeout=0.5)
        q1.close()
        q2.close()
    keys = keys_of(redis_client)
    assert all(k.startswith(("app1:", "app2:")) for k in keys), keys


def test_a_celery_app_with_a_keyprefix_runs_every_countdown_job(
        worker_factory: Factory, broker_url: str, redis_client: redis.Redis,
        rec: redis.Redis) -> None:
    """A Celery app with the option: countdown jobs all run (they were stranded), another
    app's job on the same server is not run by it, remote control reaches the worker of
    its own prefix only (fanout over pub/sub), the admin client and ``celery ext`` read
    each app's own keys,
    and every key on the server carries one of the prefixes."""
    rec.delete("runs:due", "runs:other")
    worker = worker_factory("tests.apps.proj_keyprefix", env={"TEST_KEYPREFIX": "app1:"})
    worker.start()
    app1, app2 = make_app(broker_url, "app1:"), make_app(broker_url, "app2:")
    for _ in range(10):
        app1.tasks[TASK].apply_async(("due",), countdown=1)
    app2.tasks[TASK].apply_async(("other",))
    wait_for(lambda: rec.llen("runs:due") >= 10, 30, "every countdown job of app1 ran")
    assert rec.lrange("runs:due", 0, -1) == [b"app1:"] * 10
    assert rec.llen("runs:other") == 0  # app2's job waits for a worker of app2
    assert [next(iter(reply)) for reply in app1.control.ping(timeout=2)] == \
        [worker.hostname.replace("%h", socket.gethostname())]
    assert app2.control.ping(timeout=1) == []
    sizes1 = {q["name"]: q["size"] for q in Client.from_app(app1).job_queues()}
    sizes2 = {q["name"]: q["size"] for q in Client.from_app(app2).job_queues()}
    assert sizes1.get(TASK, 0) == 0 and sizes2[TASK] == 1
    for prefix, size in (("app1:", 0), ("app2:", 1)):
        out = celery_cli("-A", "tests.apps.proj_keyprefix", "ext", "queues", "--json",
                         broker_url=broker_url, env={"TEST_KEYPREFIX": prefix})
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        items = rows["items"] if isinstance(rows, dict) else rows
        assert {q["name"]: q["size"] for q in items}.get(TASK, 0) == size, (prefix, items)
    keys = keys_of(redis_client)
    assert all(k.startswith(("app1:", "app2:")) for k in keys), keys
    assert any(k.startswith("app1:_kombu.binding.") for k in keys), keys


@pytest.mark.parametrize("prefix", ["{app}:", "app 1", "x" * 65])
def test_a_keyprefix_that_cannot_be_a_namespace_is_refused_in_one_line(
        broker_url: str, prefix: str) -> None:
    with Connection(broker_url, transport_options=prefixed(prefix)) as conn:
        with pytest.raises(ConfigError) as err:
            conn.connect()
    message = str(err.value)
    assert "global_keyprefix" in message and "\n" not in message


# -- drain_events: one event per call --------------------------------------------------------


def test_drain_events_delivers_one_message_per_call(broker_url: str,
                                                    redis_client: redis.Redis) -> None:
    """A loop of ``drain_events(timeout=1)`` gets every message, one per call (the fetch
    takes several at once; the rest wait in the channel), then times out."""
    n = 6
    queue = Queue("kc.one", routing_key="kc.one")
    got: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        message.ack()

    with Connection(broker_url) as conn:
        producer = conn.Producer()
        for i in range(n):
            producer.publish(i, routing_key="kc.one", declare=[queue])
        with conn.Consumer([queue], callbacks=[on_message]):
            for i in range(n):
                conn.drain_events(timeout=1)
                assert len(got) == i + 1, got
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.5)
    assert got == list(range(n))
    assert redis_client.llen(Keys("celery_ext").queue("kc.one")) == 0


def test_priority_messages_drain_one_per_call_in_priority_order(broker_url: str) -> None:
    """Kombu's priority example: messages of several priorities, drained with
    ``drain_events(timeout=1)`` in a loop, come one per call, lower priority number first."""
    exchange = Exchange("kc.prio_x", type="direct")
    queue = Queue("kc.prio", exchange, routing_key="kc.prio",
                  queue_arguments={"x-max-priority": 10})
    sent = [(9, "low"), (0, "high"), (3, "mid"), (6, "lower")]
    got: list[str] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        message.ack()

    with Connection(broker_url) as conn:
        producer = conn.Producer(exchange=exchange)
        for priority, body in sent:
            producer.publish(body, routing_key="kc.prio", priority=priority, declare=[queue])
        with conn.Consumer([queue], callbacks=[on_message]):
            calls = 0
            while True:
                try:
                    conn.drain_events(timeout=1)
                except TimeoutError:
                    break
                calls += 1
    assert got == ["high", "mid", "lower", "low"]
    assert calls == len(sent)


def test_jobs_kept_for_later_calls_stay_owned_and_return_when_the_channel_closes(
        broker_url: str, redis_client: redis.Redis) -> None:
    """The jobs a fetch brought beyond the one delivered stay in the pool's in-flight
    record and count as held: a reconcile returns none of them (each is delivered once).
    Kept jobs of a channel that closes are returned by the next reconcile."""
    k = Keys("celery_ext")
    queue = Queue("kc.kept", routing_key="kc.kept")
    got: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        message.ack()

    with Connection(broker_url) as conn:
        producer = conn.Producer()
        for i in range(6):
            producer.publish(i, routing_key="kc.kept", declare=[queue])
        with conn.Consumer([queue], callbacks=[on_message]):
            conn.drain_events(timeout=1)
            pool = conn.default_channel.worker_pool
            assert pool.reconcile() == []
            conn.drain_events(timeout=1)
            assert got == [0, 1]
            conn.default_channel.close()
            assert len(pool.reconcile()) == 4
    assert redis_client.llen(k.queue("kc.kept")) == 4


# -- an event loop's readers -----------------------------------------------------------------


def test_a_connection_on_a_hub_leaves_no_reader_after_reconnect_and_close(
        redis_server: RedisServer, broker_url: str) -> None:
    """Register with Kombu's Hub, consume, lose the connections (the server drops them),
    reconnect, close: none of the transport's sockets stays a reader on the hub."""
    hub = Hub()
    queue = Queue("kc.hub", routing_key="kc.hub")
    conn = Connection(broker_url)
    try:
        conn.ensure_connection()
        conn.transport.register_with_event_loop(conn.connection, hub)
        consumer = conn.Consumer([queue], no_ack=True, callbacks=[lambda body, msg: None])
        consumer.consume()
        for _ in range(3):
            hub.run_once()
        assert hub.readers
        killer = redis_server.client()
        killer.client_kill_filter(_type="normal", skipme=True)
        killer.close()
        for _ in range(3):
            try:
                hub.run_once()
            except conn.connection_errors:
                pass  # the consumer's cue to reconnect
        conn.collect()
        conn.ensure_connection()
        conn.transport.register_with_event_loop(conn.connection, hub)
        consumer.revive(conn.default_channel)
        consumer.consume()
        for _ in range(3):
            hub.run_once()
        assert hub.readers
    finally:
        conn.release()
    assert not hub.readers, hub.readers
    hub.close()


def test_a_turn_of_the_event_loop_adds_no_reader_the_loop_has(
        redis_server: RedisServer, broker_url: str) -> None:
    """Kombu's per-turn hook added every socket (fetch, wake-up, fanout) as a reader at
    every turn of the loop: a failed ``epoll_ctl`` each. Ours adds a socket's reader only
    when the loop lacks it (a new socket, or one the loop removed), and every one again at
    the ready refresh; messages still come through the loop."""
    hub = Hub()
    added: list[int] = []
    add_reader = hub.add_reader

    def counting_add_reader(fd: Any, callback: Any, *args: Any) -> Any:
        added.append(fd if isinstance(fd, int) else fd.fileno())
        return add_reader(fd, callback, *args)

    hub.add_reader = counting_add_reader  # type: ignore[method-assign]
    queue = Queue("kc.turns", routing_key="kc.turns")
    got: list[Any] = []
    conn = Connection(broker_url)
    try:
        conn.ensure_connection()
        conn.transport.register_with_event_loop(conn.connection, hub)
        consumer = conn.Consumer([queue], no_ack=True,
                                 callbacks=[lambda body, msg: got.append(body)])
        consumer.consume()
        for _ in range(5):
            hub.run_once()
        cycle = conn.transport.cycle
        ours = set(cycle.fds)
        assert ours and ours <= set(hub.readers)
        added.clear()
        for _ in range(30):  # the hooks of 30 turns (an idle turn of the loop takes 1 s)
            for hook in list(hub.on_tick):
                hook()
        assert added == [], added  # Kombu's hook: 30 turns x every socket
        fd = next(iter(ours))
        hub.remove(fd)  # the loop dropped one (its error handling does)
        for hook in list(hub.on_tick):
            hook()
        assert added == [fd] and fd in hub.readers
        added.clear()
        cycle.maybe_refresh_ready()  # the ready refresh: every reader again
        assert sorted(added) == sorted(cycle.fds)
        # The fetch the message comes by is packed by hiredis, not by redis-py's packer
        # (several times as long per fetch in a prefork main process).
        fetch_conn = conn.default_channel.client.connection
        packer = type(fetch_conn._command_packer)
        packed: list[Any] = []
        pack = packer.pack

        def counting_pack(self: Any, *args: Any) -> Any:
            packed.append(args[0])
            return pack(self, *args)

        packer.pack = counting_pack  # type: ignore[method-assign]
        try:
            conn.Producer().publish({"n": 1}, routing_key="kc.turns", declare=[queue])
            wait_for(lambda: hub.run_once() or got, 5, "the message through the loop")
        finally:
            packer.pack = pack  # type: ignore[method-assign]
        assert got == [{"n": 1}]
        assert "EVALSHA" not in packed, packed
    finally:
        conn.release()
    hub.close()


def test_a_keyprefix_on_a_cluster_prefixes_every_copy(cluster: ClusterGroup,
                                                      cluster_url: str) -> None:
    """On a cluster the prefix goes before each job queue's own tag (``{ns:queue}``) and the
    home tag alike: put, get, requeue, get delivers again, and every key the round wrote,
    on every master, carries the prefix."""
    namespace = f"kp-{uuid.uuid4().hex[:8]}"
    options = {"cluster": True, "namespace": namespace, **prefixed("app1:")}
    with Connection(cluster_url, transport_options=options) as conn:
        queue = conn.SimpleQueue("kc.cl")
        queue.put({"n": 1})
        first = queue.get(timeout=5)
        first.requeue()
        again = queue.get(timeout=5)
        assert again.payload == {"n": 1}
        again.ack()
        queue.close()
    written: list[str] = []
    for master in cluster.master_servers():
        with master.client() as c:
            mine = [k.decode() for k in c.scan_iter(match=f"*{namespace}*", count=1000)]
            for key in mine:  # one at a time: a master's keys may sit in different slots
                c.delete(key)
            written += mine
    assert any(k.startswith(f"app1:{{{namespace}:kc.cl}}:") for k in written), written
    assert all(k.startswith("app1:") for k in written), written
