"""A TCP proxy that can cut every connection through it: a network partition.

A worker pool that reaches Redis through it can be cut off (``stop()`` closes the
listener and every open connection, so new connects are refused) and reconnected
(``start()`` listens again on the same port), without touching the processes.

``lose_reply_to(pattern)`` breaks one round trip in the middle instead: the next
request containing ``pattern`` is forwarded to Redis, which runs it, and the
connection is closed when Redis answers, the reply unread by the client (a fault
inside the round trip: the write landed, the client cannot know).
"""

from __future__ import annotations

import socket
import threading
from typing import Self


class Proxy:
    """Forward ``127.0.0.1:<port>`` to ``upstream``; ``stop()``/``start()`` cut and heal."""

    def __init__(self, upstream: tuple[str, int], port: int = 0) -> None:
        self.upstream = upstream
        self.port = port
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._lose_reply_to: bytes | None = None
        self._doomed: set[socket.socket] = set()  # server sockets whose reply is dropped
        #: Replies dropped so far (each with its connection).
        self.lost_replies = 0

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

    def lose_reply_to(self, pattern: bytes | None) -> None:
        """Forward the next request that contains ``pattern``, then drop its reply and
        close that connection (once; None disarms)."""
        with self._lock:
            self._lose_reply_to = pattern

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
                if upstream and self._lose_reply_to is not None:
                    with self._lock:
                        if self._lose_reply_to is not None and self._lose_reply_to in data:
                            self._lose_reply_to = None
                            self._doomed.add(dst)  # before Redis can answer
                elif not upstream and src in self._doomed:
                    with self._lock:
                        self._doomed.discard(src)
                        self.lost_replies += 1
                    break  # the reply is dropped; both sockets close below
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with self._lock:
                    self._conns.discard(sock)
                _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
