"""config/: what a user deploys (the server configuration, the Prometheus rules, the
Grafana dashboard, a production celeryconfig.py), as the tests find and install it."""

from __future__ import annotations

from pathlib import Path

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
