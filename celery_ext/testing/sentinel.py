"""Redis Sentinel in child processes: a primary, its replicas and a quorum of sentinels
on 127.0.0.1, for tests and chaos scenarios of failover (see :mod:`celery_ext.testing.node`
for one server)."""

from __future__ import annotations

from types import TracebackType
from typing import Any
from urllib.parse import quote

import redis

from celery_ext.testing.node import HOST, RedisServer, ServerError, link_up, wait_until

__all__ = ["SentinelGroup", "SentinelServer"]


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
        self._wait(lambda: all(link_up(r) for r in self.servers[1:]), timeout,
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
        self._wait(lambda: link_up(server), timeout, "the rejoining server did not sync")

    def views(self) -> list[tuple[str, int] | None]:
        """The primary each running sentinel names (None: no answer)."""
        out: list[tuple[str, int] | None] = []
        for sentinel in self.sentinels:
            if not sentinel.running:
                out.append(None)
                continue
            try:
                with sentinel.client(socket_timeout=1.0) as c:
                    addr = _sentinel(c, "GET-MASTER-ADDR-BY-NAME", self.master_name)
            except redis.RedisError:
                addr = None
            out.append((_text(addr[0]), int(addr[1])) if addr else None)
        return out

    def master_server(self) -> RedisServer | None:
        """The server the sentinels name primary, if it is one of ours."""
        addr = self.master()
        return next((s for s in self.servers if addr and s._port == addr[1]), None)

    def url(self, scheme: str = "celery-ext+sentinel", db: int = 0) -> str:
        """The ``;``-separated sentinel URL (the password, if any, is the primary's)."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return ";".join(f"{scheme}://{auth}{HOST}:{s.port}/{db}" for s in self.sentinels)

    _wait = staticmethod(wait_until)

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()



def _knows(sentinel: SentinelServer, name: str, replicas: int, others: int) -> bool:
    try:
        with sentinel.client(socket_timeout=1.0) as c:
            reply = _sentinel(c, "MASTER", name)
    except redis.RedisError:
        return False
    fields = reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2], strict=True))
    master = {_text(k): v for k, v in fields.items()}
    return (int(master.get("num-slaves", 0)) >= replicas
            and int(master.get("num-other-sentinels", 0)) >= others)


def _sentinel(client: redis.Redis, *args: str) -> Any:
    """``SENTINEL <args>``'s reply as the server sent it: redis-py 6.4's parsers of
    ``SENTINEL MASTER`` and ``GET-MASTER-ADDR-BY-NAME`` refuse the option its own
    ``sentinel_*`` methods pass them (a TypeError), and a command named ``SENTINEL``
    alone has no parser in any version."""
    return client.execute_command("SENTINEL", *args)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
