"""A connection gone silent (half-open) or a server stalled: the plugin's connections tell
them apart by probing the server on a fresh connection (``celery_ext.store.probe``).

Real server, real sockets: a TCP proxy leaves connections open while passing nothing
(``Proxy.freeze``), DEBUG SLEEP and CLIENT PAUSE stall the server. With the default
timings a silent connection fails within ``reply_probe_after`` + ``probe_timeout`` and
the next command reconnects; a stalled server is waited for on the same connection,
with a few probe connections and no reconnect.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from kombu import Connection

from celery_ext.config import DEFAULT_PROBE_TIMEOUT, DEFAULT_REPLY_PROBE_AFTER, Settings
from celery_ext.store.connections import watch_replies
from celery_ext.testing.server import RedisServer
from celery_ext.worker.acks import AckSender
from tests.faults.proxy import Proxy

#: A silent connection fails by then (probe due, probe answered, a second to spare).
NOTICED_WITHIN = DEFAULT_REPLY_PROBE_AFTER + DEFAULT_PROBE_TIMEOUT + 1.0


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer(extra_args=["--enable-debug-command", "yes"]) as s:
        yield s


@pytest.fixture
def proxy(server: RedisServer) -> Iterator[Proxy]:
    p = Proxy(("127.0.0.1", server.port)).start()
    yield p
    p.stop()


def pool_via(proxy: Proxy) -> redis.ConnectionPool:
    """A connection pool built as the transport builds its own (default settings)."""
    params = watch_replies({"host": "127.0.0.1", "port": proxy.port, "db": 0}, Settings())
    return redis.ConnectionPool(**params)


def accepted(server: RedisServer) -> int:
    with server.client(socket_timeout=60) as c:
        return int(c.info("stats")["total_connections_received"])


def stall(server: RedisServer, *command: str) -> threading.Thread:
    """Run ``command`` (DEBUG SLEEP, CLIENT PAUSE) on an admin connection, in a thread."""
    def run() -> None:
        with server.client(socket_timeout=60) as c:
            c.execute_command(*command)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.3)  # (it has reached the server)
    return t


def test_a_command_on_a_half_open_connection_fails_soon_and_the_next_reconnects(
        proxy: Proxy) -> None:
    client = redis.Redis(connection_pool=pool_via(proxy))
    assert client.ping()
    proxy.freeze()
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError, match="half-open"):
        client.get("silent")
    took = time.monotonic() - started
    assert DEFAULT_REPLY_PROBE_AFTER <= took < NOTICED_WITHIN
    assert client.set("silent", 1)  # a new connection


def test_a_stalled_server_is_waited_for_on_the_same_connection(
        server: RedisServer, proxy: Proxy) -> None:
    """DEBUG SLEEP three times ``reply_probe_after``: the command's reply comes after
    it, on its connection; the probes that went unanswered cost a few connections."""
    client = redis.Redis(connection_pool=pool_via(proxy))
    before_id = client.client_id()
    before = accepted(server)
    seconds = DEFAULT_REPLY_PROBE_AFTER * 3
    sleeper = stall(server, "DEBUG", "SLEEP", str(seconds))
    started = time.monotonic()
    assert client.incr("stalled") >= 1
    assert time.monotonic() - started >= seconds - 1
    sleeper.join()
    assert client.client_id() == before_id  # no reconnect
    # This test's own: the stall's and the two counts' connections; at most 2 probes.
    assert accepted(server) - before <= 3 + 2


def test_a_reply_read_long_after_its_request_costs_no_probe(
        server: RedisServer, proxy: Proxy) -> None:
    """The acks read their replies late, on purpose: a reply already there is read
    without probing the server, however long ago its request went out."""
    pool = pool_via(proxy)
    conn = pool.get_connection()
    try:
        before = accepted(server)
        conn.send_command("PING")
        time.sleep(DEFAULT_REPLY_PROBE_AFTER + 0.5)
        assert conn.read_response() == b"PONG"
        assert accepted(server) - before == 1  # the count's own connection
    finally:
        pool.release(conn)
        pool.disconnect()


def test_a_write_pause_holds_the_probe_back_too(server: RedisServer, proxy: Proxy) -> None:
    """CLIENT PAUSE WRITE holds writes and scripts, not PING: the probe is a script, so
    a held write is not mistaken for a dead connection."""
    client = redis.Redis(connection_pool=pool_via(proxy))
    before_id = client.client_id()
    seconds = DEFAULT_REPLY_PROBE_AFTER * 2.5
    stall(server, "CLIENT", "PAUSE", str(int(seconds * 1000)), "WRITE")
    started = time.monotonic()
    assert client.incr("paused") >= 1
    assert time.monotonic() - started >= seconds - 1
    assert client.client_id() == before_id


def test_acks_on_a_half_open_connection_are_resent(proxy: Proxy) -> None:
    """The acks' own connection goes silent after an ack was written: polling (about
    once a second in a worker) hands that ack to the synchronous path soon."""
    resent: list[str] = []
    sender = AckSender(pool_via(proxy), fallback=resent.extend)
    sender.connect()
    proxy.freeze()
    started = time.monotonic()
    sender.ack([], [], ["tag-1"])
    while not resent and time.monotonic() - started < 3 * NOTICED_WITHIN:
        sender.poll()
        time.sleep(0.2)
    assert resent == ["tag-1"]
    assert time.monotonic() - started < NOTICED_WITHIN + 1.0  # (the poll's own pace)
    sender.close()


def test_connections_keep_alive(proxy: Proxy) -> None:
    """TCP keep-alive on (with short timings where the system lets us set them): a peer
    that vanished is found on connections that wait for no reply (pub/sub) too."""
    pool = pool_via(proxy)
    conn = pool.get_connection()
    try:
        sock = conn._sock
        assert sock is not None
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) <= 10
    finally:
        pool.release(conn)
        pool.disconnect()


def test_a_connection_the_server_closed_while_idle_is_replaced_by_the_health_check(
        server: RedisServer) -> None:
    """The server drops an idle consumer's connections (a restart, its ``timeout``,
    CLIENT KILL): the next wait for a message, past the health check's interval, finds
    its fetch connection closed at the check's PING, connects again and delivers, instead
    of failing the caller (``inspect()`` raised "Broken pipe" on such a connection). The
    PING never reached the server, so sending it again is safe; the request after it was
    not sent at all."""
    url = server.url(scheme="celery-ext")
    with Connection(url, transport_options={"health_check_interval": 1}) as conn:
        queue = conn.SimpleQueue("idle-closed")
        queue.put({"n": 1})
        assert queue.get(timeout=5).payload == {"n": 1}
        with server.client() as admin:
            assert admin.client_kill_filter(_type="normal", skipme=True) >= 1
        time.sleep(1.5)  # past the health check's interval
        queue.put({"n": 2})
        message = queue.get(timeout=5)
        assert message.payload == {"n": 2}
        message.ack()
        queue.close()
