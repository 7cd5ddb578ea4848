"""A TCP proxy that can cut every connection through it: a network partition.

A worker pool that reaches Redis through it can be cut off (``stop()`` closes the
listener and every open connection, so new connects are refused) and reconnected
(``start()`` listens again on the same port), without touching the processes.

``cut_on_reply(trigger)`` strikes *inside* a round trip: the next request that
contains ``trigger`` reaches Redis, which runs it, and the connection that carries
it is cut when the reply comes back, so the client never reads it.
``drop_request(trigger, refuse_for)`` strikes before: the request never reaches
Redis, its connection is cut, and new connections are refused for a while, while
the other open connections go on.
``freeze_on(trigger)`` leaves a connection half-open instead: the next request that
contains ``trigger`` reaches Redis (or, ``forward=False``, does not), and from then on
nothing more passes that connection either way, while it stays open (no FIN, no
reset), as when a NAT or load balancer drops its state. ``answered_at`` says when a
later request containing ``trigger``, on another connection, got its reply: the
client noticed and went on.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Self


class Proxy:
    """Forward ``127.0.0.1:<port>`` to ``upstream``; ``stop()``/``start()`` cut and heal."""

    def __init__(self, upstream: tuple[str, int], port: int = 0) -> None:
        self.upstream = upstream
        self.port = port
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        #: Requests still to be cut at their reply (see cut_on_reply), and how many were.
        self._triggers: list[bytes] = []
        self._doomed: set[socket.socket] = set()
        self.replies_cut = 0
        self._drops: list[tuple[bytes, float]] = []
        self._frozen: set[socket.socket] = set()
        #: Requests to leave half-open at (see freeze_on): (trigger, forward).
        self._freezes: list[tuple[bytes, bool]] = []
        #: When the last freeze_on struck; when a later request with its trigger was
        #: answered on another connection; the server sides awaiting that answer.
        self.frozen_at: float | None = None
        self.answered_at: float | None = None
        self._watch: bytes | None = None
        self._awaiting: set[socket.socket] = set()
        self._refuse_until = 0.0
        self.requests_dropped = 0

    def freeze(self) -> None:
        """Stop forwarding on every open connection without closing it (a half-open
        connection: no reset, no reply, ever); new connections work."""
        with self._lock:
            self._frozen = set(self._conns)

    def freeze_on(self, trigger: bytes, forward: bool = True) -> None:
        """Leave the connection of the next request containing ``trigger`` half-open:
        the request is forwarded (``forward``; Redis runs it) or swallowed, and nothing
        passes that connection afterwards, either way; it is not closed."""
        with self._lock:
            self._freezes.append((trigger, forward))
            self.frozen_at = self.answered_at = self._watch = None
            self._awaiting.clear()

    def drop_request(self, trigger: bytes, refuse_for: float = 1.0) -> None:
        """Cut the connection of the next request containing ``trigger`` without
        forwarding it, and refuse new connections for ``refuse_for`` seconds."""
        with self._lock:
            self._drops.append((trigger, refuse_for))

    def cut_on_reply(self, trigger: bytes, times: int = 1) -> None:
        """Cut the connection of each of the next ``times`` requests containing
        ``trigger`` once Redis has run it and its reply arrives (the reply is dropped)."""
        with self._lock:
            self._triggers += [trigger] * times

    def disarm(self) -> None:
        """Forget the cuts and drops not yet struck."""
        with self._lock:
            self._triggers.clear()
            self._drops.clear()
            self._freezes.clear()

    def start(self) -> Self:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True,
                         name="proxy-accept").start()
        return self

    def stop(self) -> None:
        """Close the listener and every connection: clients see resets and refusals."""
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            _close(conn)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            if time.monotonic() < self._refuse_until:
                _close(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                if self._listener is not listener:
                    _close(client)
                    _close(server)
                    return
                self._conns.update((client, server))
            for src, dst, upstream in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, upstream), daemon=True,
                                 name="proxy-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while data := src.recv(65536):
                if src in self._frozen:
                    continue  # swallowed
                if upstream and self._drops:
                    with self._lock:
                        hit = next((d for d in self._drops if d[0] in data), None)
                        if hit is not None:
                            self._drops.remove(hit)
                            self._refuse_until = time.monotonic() + hit[1]
                            self.requests_dropped += 1
                    if hit is not None:
                        break  # never forwarded
                if upstream and (self._freezes or self._watch is not None):
                    with self._lock:
                        if self._watch is not None and self._watch in data:
                            self._awaiting.add(dst)
                        freeze = next((f for f in self._freezes if f[0] in data), None)
                        if freeze is not None:
                            self._freezes.remove(freeze)
                            self._frozen.update((src, dst))
                            self.frozen_at = time.monotonic()
                            self._watch = freeze[0]
                            self._awaiting.discard(dst)
                    if freeze is not None and not freeze[1]:
                        continue  # swallowed with everything after it
                elif not upstream and src in self._awaiting:
                    with self._lock:
                        self._awaiting.discard(src)
                        if self.answered_at is None:
                            self.answered_at = time.monotonic()
                if upstream and self._triggers:
                    with self._lock:
                        hit = next((t for t in self._triggers if t in data), None)
                        if hit is not None:
                            self._triggers.remove(hit)
                            self._doomed.add(dst)  # the server side of this connection
                elif not upstream and src in self._doomed:
                    with self._lock:
                        self._doomed.discard(src)
                        self.replies_cut += 1
                    break  # Redis ran it; its reply is dropped with the connection
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with self._lock:
                    self._conns.discard(sock)
                    self._frozen.discard(sock)
                    self._awaiting.discard(sock)
                _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
