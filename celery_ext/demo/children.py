"""The demo's child processes (server aside): each in its own process group, its output
in a log file, stopped by the demo in order; and the waits for them to answer."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path


class Child:
    """A subprocess in its own process group, its output in a log file."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log_dir: Path
                 ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                list(argv), env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _signal_group(self, sig: int) -> None:
        # The group id is the leader's pid (start_new_session); the group may outlive
        # its leader (a prefork child), so it is signalled even after the leader exits.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL the whole group (the pool's main process and its children), as a
        lost host would."""
        self._signal_group(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal_group(signal.SIGTERM)

    def wait_stopped(self, deadline: float) -> bool:
        """Wait for the leader until ``deadline`` (monotonic), then SIGKILL what is left
        of the group; True if it stopped by itself."""
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
            clean = True
        except subprocess.TimeoutExpired:
            clean = False
        self._signal_group(signal.SIGKILL)
        self.proc.wait()
        return clean


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def pick_port(wanted: int) -> int:
    """``wanted`` if it is free, else (or for 0) any free port."""
    if wanted and _port_free(wanted):
        return wanted
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def answers(url: str) -> bool:
    """Does ``url`` answer 200 now?"""
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def wait_until(what: str, cond: Callable[[], bool], children: Sequence[Child],
               timeout: float) -> None:
    """Poll ``cond``; RuntimeError if a child exits meanwhile or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not cond():
        for child in children:
            if not child.running:
                raise RuntimeError(f"{child.name} exited with code {child.proc.returncode} "
                                   f"while waiting for {what}:\n{child.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)
