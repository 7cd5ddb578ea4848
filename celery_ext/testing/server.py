"""Real Redis/Valkey servers in child processes, for tests, the demo and benchmarks.

The one import path for all of them: one node (:mod:`celery_ext.testing.node`), a
Sentinel group (:mod:`celery_ext.testing.sentinel`) and a cluster
(:mod:`celery_ext.testing.cluster`). ``python -m celery_ext.testing.server`` runs one
node in the foreground and prints its ``celery-ext://`` URL.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from celery_ext.testing.cluster import CLUSTER_SLOTS, ClusterGroup
from celery_ext.testing.node import (
    HOST,
    RedisServer,
    ServerError,
    find_cli_binary,
    find_server_binary,
)
from celery_ext.testing.sentinel import SentinelGroup, SentinelServer

__all__ = ["CLUSTER_SLOTS", "HOST", "ClusterGroup", "RedisServer", "SentinelGroup",
           "SentinelServer", "ServerError", "find_cli_binary", "find_server_binary", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run a server in the foreground until Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="python -m celery_ext.testing.server", description=main.__doc__
    )
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    parser.add_argument("--dir", default=None, help="data dir (default: a temp dir, removed)")
    parser.add_argument("--password", default=None)
    parser.add_argument("--appendfsync", default="always", choices=["always", "everysec", "no"])
    # Our scheme by default: a redis:// URL pasted as a broker URL silently gives stock Kombu.
    parser.add_argument("--scheme", default="celery-ext",
                        help="URL scheme to print (default celery-ext; redis for a plain client)")
    args = parser.parse_args(argv)

    server = RedisServer(
        port=args.port, data_dir=args.dir, password=args.password, appendfsync=args.appendfsync
    )

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)  # even if started with SIGINT ignored (`cmd &`)
    # One try from the start: a signal that comes while the URL is being printed (the
    # caller may act on the URL at once) stops the server like any other.
    try:
        try:
            server.start()
        except ServerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(server.url(scheme=args.scheme), flush=True)
        print(f"data dir {server.data_dir}, pid {server.pid}; Ctrl-C stops it", file=sys.stderr)
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
