"""Real ``celery worker`` subprocesses for end-to-end tests.

Crash safety can only be tested against real processes: a worker killed with
SIGKILL, prefork children orphaned mid-task, a warm shutdown on SIGTERM. Each
process runs in its own session (process group), so signals aimed at pytest do not
reach it and teardown can kill everything it left behind by that group id.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Celery logs "<hostname> ready." once the worker consumes.
READY_PATTERN = r"\S+@\S+ ready\."

_counter = itertools.count(1)
# Started processes; whatever is left of them at interpreter exit is SIGKILLed.
_STARTED: list[ManagedProcess] = []


@atexit.register
def _kill_leftovers() -> None:
    for proc in _STARTED:
        proc._kill_group()


class ProcessError(RuntimeError):
    """A managed process did not get ready or exited early; the message has its log tail."""


class ManagedProcess:
    """A subprocess with its output in a log file, a readiness line and tree cleanup."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_path: Path,
        cwd: Path = REPO_ROOT,
        env: Mapping[str, str] | None = None,
        ready_pattern: str | None = None,
    ) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        self.cwd = cwd
        self.env = dict(os.environ if env is None else env)
        self.ready_pattern = ready_pattern
        #: ``stop()`` had to SIGKILL it: it did not exit within its timeout.
        self.stop_timed_out = False
        self._proc: subprocess.Popen[bytes] | None = None
        #: The signal :meth:`send` sent, which :meth:`stop` then does not send again.
        self._sent: int | None = None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise ProcessError("process not started")
        return self._proc.pid

    @property
    def started(self) -> bool:
        return self._proc is not None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def start(self, wait_ready: bool = True, timeout: float = 30) -> Self:
        """Spawn the process; with ``wait_ready``, block until ``ready_pattern`` is logged."""
        if self._proc is not None:
            raise ProcessError(f"already started (pid {self._proc.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _STARTED.append(self)
        if wait_ready and self.ready_pattern:
            self.wait_for_log(self.ready_pattern, timeout)
        return self

    def wait_for_log(self, pattern: str, timeout: float = 30) -> re.Match[str]:
        """Wait until ``pattern`` (a multiline regex) appears in the log; return the match."""
        regex = re.compile(pattern, re.MULTILINE)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.log_text())
            if match:
                return match
            if not self.alive:
                raise ProcessError(
                    f"process exited with code {self.returncode} before logging {pattern!r}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ProcessError(
                    f"{pattern!r} not logged within {timeout}s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def send(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` without waiting; a later ``stop(sig)`` waits without sending it
        again (a second SIGTERM is not a warm shutdown's). Several processes that each
        take seconds to stop then stop at once."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(sig)
            self._sent = sig

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Send ``sig``, wait for exit (SIGKILL after ``timeout``) and return the exit code.

        Whatever the process left behind in its group (orphaned prefork children) is
        then SIGKILLed, so nothing outlives the test.
        """
        if self._proc is None:
            raise ProcessError("process not started")
        proc = self._proc
        if proc.poll() is None:
            if self._sent != sig:
                proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.stop_timed_out = True
                self._before_kill()
                proc.kill()
                proc.wait()
        self._kill_group()
        return proc.returncode

    def _before_kill(self) -> None:
        """It did not stop in time and is about to be SIGKILLed: say where it hangs."""

    def kill(self) -> None:
        """SIGKILL the main process only, as a crash would; its children live on."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def child_pids(self) -> list[int]:
        """PIDs of the live direct children (the prefork pool); empty once the main is gone."""
        if not self.alive:
            return []
        try:
            children = psutil.Process(self.pid).children()
        except psutil.NoSuchProcess:
            return []
        pids = []
        for child in children:
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    pids.append(child.pid)
            except psutil.NoSuchProcess:
                continue
        return sorted(pids)

    def group_pids(self) -> list[int]:
        """PIDs still in this process's group, including orphaned children."""
        if self._proc is None:
            return []
        pids = []
        for proc in psutil.process_iter():
            try:
                if os.getpgid(proc.pid) == self._proc.pid and proc.status() != psutil.STATUS_ZOMBIE:
                    pids.append(proc.pid)
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue
        return sorted(pids)

    def _kill_group(self) -> None:
        # The group id is our child's PID; Linux does not reuse it while the group lives.
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + 5
        while self.group_pids() and time.monotonic() < deadline:
            time.sleep(0.02)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __repr__(self) -> str:
        pid = self._proc.pid if self._proc else None
        return f"<{type(self).__name__} pid={pid} alive={self.alive} log={self.log_path}>"


class WorkerProcess(ManagedProcess):
    """``celery -A <app> worker`` against ``broker_url`` (passed as CELERY_EXT_BROKER_URL)."""

    def __init__(
        self,
        app: str,
        broker_url: str,
        *,
        pool: str = "prefork",
        concurrency: int = 2,
        queues: list[str] | None = None,
        hostname: str | None = None,
        env: dict[str, str] | None = None,
        log_dir: Path,
        extra_args: Sequence[str] = (),
    ) -> None:
        n = next(_counter)
        self.app = app
        self.broker_url = broker_url
        self.hostname = hostname or f"w{n}.{os.getpid()}@%h"
        argv = [
            sys.executable, "-m", "celery", "-A", app, "worker",
            "-P", pool, "-c", str(concurrency), "-n", self.hostname,
            "--loglevel=INFO", "--without-gossip", "--without-mingle",
        ]
        if queues:
            argv += ["-Q", ",".join(queues)]
        argv += list(extra_args)
        full_env = dict(os.environ)
        full_env.update(
            CELERY_EXT_BROKER_URL=broker_url,
            PYTHONPATH=os.pathsep.join(
                p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
            PYTHONUNBUFFERED="1",
        )
        full_env.update(env or {})
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", self.hostname.split("@")[0])
        super().__init__(
            argv,
            log_path=log_dir / f"worker-{n}-{name}.log",
            env=full_env,
            ready_pattern=READY_PATTERN,
        )

    def _before_kill(self) -> None:
        """Celery's SIGUSR1 handler writes every thread's stack to the log: a shutdown
        that hangs leaves its reason there."""
        try:
            os.kill(self.pid, signal.SIGUSR1)
            time.sleep(2.0)
        except ProcessLookupError:
            pass
