"""config/: what a user deploys (the server configuration, the Prometheus rules, the
Grafana dashboard, a production celeryconfig.py), as the tests find and install it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from celery_ext.testing.server import find_server_binary
from tests.helpers import free_port, wait_for
from tests.workers import REPO_ROOT

CONFIG = REPO_ROOT / "config"
#: The server files, each including the one before it from where it is installed.
SERVER_FILES = ("valkey.conf", "valkey-replicated.conf", "valkey-cluster.conf")
#: Where the server files are installed (the example stacks mount config/ there).
INSTALLED_AT = "/etc/valkey/"


def installed(into: Path) -> Path:
    """config/'s server files copied into ``into`` as if it were /etc/valkey: their
    ``include`` lines name ``into`` instead (a server resolves them from its own cwd)."""
    into.mkdir(parents=True, exist_ok=True)
    for name in SERVER_FILES:
        text = (CONFIG / name).read_text()
        (into / name).write_text(text.replace(INSTALLED_AT, f"{into.resolve()}/"))
    return into


@contextmanager
def server(conf: Path, data: Path, *args: str) -> Iterator[redis.Redis]:
    """A real server loading ``conf`` as it is (only where to listen and write changed)."""
    data.mkdir(parents=True)
    port = free_port()
    log = data / "server.log"
    proc = subprocess.Popen(
        [find_server_binary(), str(conf), "--port", str(port), "--bind", "127.0.0.1",
         "--dir", str(data), "--daemonize", "no", *args],
        stdin=subprocess.DEVNULL, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    client = redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2,
                         decode_responses=True)

    def up() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    try:
        wait_for(up, 15, f"a server with config/{conf.name}")
        yield client
    finally:
        client.close()
        # A replica writing its first AOF after a full sync refuses to exit ("Writing
        # initial AOF, can't exit"): asked again until it has.
        for _ in range(30):
            proc.terminate()
            try:
                proc.wait(1)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            proc.kill()
            proc.wait(5)
