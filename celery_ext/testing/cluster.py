"""A Redis/Valkey Cluster in child processes on 127.0.0.1, for tests, chaos scenarios and
benchmarks (see :mod:`celery_ext.testing.node` for one server)."""

from __future__ import annotations

from types import TracebackType
from typing import Any

import redis

from celery_ext.testing.node import HOST, RedisServer, ServerError, free_port, link_up, wait_until

__all__ = ["CLUSTER_SLOTS", "ClusterGroup"]

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
        self._bus_ports = [free_port() for _ in range(count)]
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
            self._wait(lambda: all(link_up(r) for r in self.replica_servers()), timeout,
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
                self._bus_ports[i] = free_port()
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

    _wait = staticmethod(wait_until)

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
