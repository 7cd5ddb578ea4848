"""Debian packages a test needs (chromium, prometheus, ...), installed when missing.

Tests run in several processes at once (pytest-xdist), and dpkg takes one lock per
machine: every install here goes through one file lock, so two test processes that
need a package wait for each other instead of failing on dpkg's lock.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "celery-ext"


@contextmanager
def machine_lock(name: str = "apt") -> Iterator[None]:
    """Hold an exclusive lock shared by every test process on this machine."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _apt(*args: str, timeout: float) -> bool:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        return subprocess.run(["apt-get", *args], env=env, capture_output=True,
                              timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ensure_installed(package: str, path: str) -> str:
    """``path`` once ``package`` is installed (``apt-get install``, refreshing the package
    lists once if needed), or a one-line reason it could not be: the caller skips with it.

    Returns the path on success; raises :class:`LookupError` with the reason otherwise.
    """
    if os.path.exists(path):
        return path
    if shutil.which("apt-get") is None:
        raise LookupError(f"{path} is missing and apt-get is not available to install {package}")
    with machine_lock():
        if os.path.exists(path):  # another test process installed it meanwhile
            return path
        if not _apt("install", "-y", "-q", package, timeout=900):
            _apt("update", "-q", timeout=300)
            _apt("install", "-y", "-q", package, timeout=900)
    if not os.path.exists(path):
        raise LookupError(f"`apt-get install {package}` did not provide {path}")
    return path
