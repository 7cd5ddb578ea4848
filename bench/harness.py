"""Process and server plumbing for the benchmark: one server, workers, snapshots.

The harness starts ONE fresh server and runs every subprocess (workers, producers)
against it. Pre-filled queues are made once per transport and layout with the real
producer, saved as a snapshot in a spare database (``COPY ... DB n``) and restored
before every round, so each drain starts from the same 20,000 distinct jobs without
paying the enqueue time again.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis

from bench import app as bench_app
from celery_ext.testing.server import RedisServer

REPO_ROOT = Path(__file__).resolve().parent.parent
#: The two contenders: stock Kombu ``redis://`` and ours (``celery-ext://`` + install).
MODES = ("stock", "ours")
#: Dramatiq (its own Redis broker, ``bench.dramatiq_app``): a third side of the enqueue
#: and drain workloads.
DRAMATIQ = "dramatiq"
SCHEMES = {"stock": "redis", "ours": "celery-ext", DRAMATIQ: "redis"}
BROKER_DB = 0
#: Spare databases that hold pre-filled snapshots (db 2 is the jobs' counter db).
SNAPSHOT_DBS = tuple(range(3, 16))
#: Flags every benchmark worker gets, for both transports: no mingle/gossip/heartbeat
#: events, and warnings only (INFO logs two lines per job).
WORKER_FLAGS = ("--loglevel=WARNING", "--without-gossip", "--without-mingle",
                "--without-heartbeat")

_ids = itertools.count(1)


class BenchError(RuntimeError):
    """A worker or client failed or timed out; the message has its log tail."""


@dataclass(eq=False)
class Proc:
    """A subprocess in its own process group, logged to a file, stopped by PID."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv, cwd=REPO_ROOT, env=self.env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _RUNNING.add(self)
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tree(self) -> list[psutil.Process]:
        """The process and its live descendants (prefork children)."""
        try:
            main = psutil.Process(self.pid)
            return [main, *main.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def usage(self) -> dict[str, float]:
        """CPU seconds and RSS (bytes) of the main process and of the whole tree."""
        out = {"cpu_main": 0.0, "cpu_tree": 0.0, "rss_main": 0.0, "rss_tree": 0.0}
        for i, proc in enumerate(self.tree()):
            try:
                cpu = proc.cpu_times()
                secs = cpu.user + cpu.system
                rss = float(proc.memory_info().rss)
            except psutil.NoSuchProcess:
                continue
            out["cpu_tree"] += secs
            out["rss_tree"] += rss
            if i == 0:
                out["cpu_main"], out["rss_main"] = secs, rss
        return out

    def stop(self, graceful: bool = False, timeout: float = 20.0) -> None:
        """Kill the process group (SIGKILL) by our child's PID, which is its group id.

        Measurements are taken before this and the harness flushes the server after
        every run, so the default skips Celery's warm shutdown (seconds per worker;
        20 s and more for a stock prefork pool with jobs still queued). ``graceful``
        sends SIGTERM first and waits up to ``timeout``.
        """
        popen = self.popen
        if popen is None:
            return
        if graceful and popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        popen.wait()
        _RUNNING.discard(self)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


_RUNNING: set[Proc] = set()


@dataclass(eq=False)
class ProcGroup:
    """Several workers started, measured and stopped as one: a pool "sized to match"
    Dramatiq's processes runs one ``celery worker`` per process. Usage sums the trees;
    ``cpu_main``/``rss_main`` sum the main processes."""

    procs: list[Proc]

    def start(self) -> ProcGroup:
        for proc in self.procs:
            proc.start()
        return self

    def alive(self) -> bool:
        return all(proc.alive() for proc in self.procs)

    def usage(self) -> dict[str, float]:
        out = {"cpu_main": 0.0, "cpu_tree": 0.0, "rss_main": 0.0, "rss_tree": 0.0}
        for proc in self.procs:
            for key, value in proc.usage().items():
                out[key] += value
        return out

    def stop(self, graceful: bool = False, timeout: float = 20.0) -> None:
        for proc in self.procs:
            proc.stop(graceful, timeout)

    def _telling(self) -> Proc:
        """The worker whose log tells what went wrong: the first that died, else the first."""
        return next((p for p in self.procs if not p.alive()), self.procs[0])

    @property
    def log_path(self) -> Path:
        return self._telling().log_path

    def log_tail(self, lines: int = 30) -> str:
        return self._telling().log_tail(lines)


def stop_all() -> None:
    """Stop every process the harness started and has not stopped yet."""
    for proc in list(_RUNNING):
        proc.stop()


@dataclass
class Bench:
    """One server and everything needed to run workloads against it."""

    server: RedisServer
    log_dir: Path
    env_base: dict[str, str] = field(default_factory=dict)
    _clients: dict[int, redis.Redis] = field(default_factory=dict)
    #: Snapshot name -> the spare database holding it.
    _snapshots: dict[str, int] = field(default_factory=dict)

    @classmethod
    @contextmanager
    def open(cls, log_dir: Path, aof: str = "no", debug: bool = False) -> Iterator[Bench]:
        """Start a fresh server (AOF per ``aof``: no, everysec, always); stop it after.
        ``debug``: ``DEBUG`` allowed from local clients (``DEBUG HTSTATS`` tells whether
        the keyspace is being rehashed; Redis 7.0 and later)."""
        extra = ["--databases", "16"] + (["--enable-debug-command", "local"] if debug else [])
        server = RedisServer(appendonly=aof != "no",
                             appendfsync=aof if aof != "no" else "everysec",
                             extra_args=extra)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_EXT_")}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        with server:
            bench = cls(server=server, log_dir=log_dir, env_base=env)
            try:
                yield bench
            finally:
                stop_all()

    # -- clients ----------------------------------------------------------------------
    def client(self, db: int = BROKER_DB) -> redis.Redis:
        """The harness's client on ``db`` (one connection each, reused: opening new
        ones would show up in the command counts)."""
        c = self._clients.get(db)
        if c is None:
            c = self._clients[db] = self.server.client(db=db)
        return c

    @property
    def counter(self) -> redis.Redis:
        return self.client(bench_app.COUNTER_DB)

    def info(self, section: str) -> dict[str, Any]:
        return dict(self.client().info(section))

    def server_version(self) -> str:
        info = self.info("server")
        return str(info.get("valkey_version") or info.get("redis_version"))

    def redis_cpu(self) -> float:
        cpu = self.info("cpu")
        return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])

    def commandstats(self) -> dict[str, int]:
        stats = self.info("commandstats")
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}

    def flush(self, *dbs: int) -> None:
        """FLUSHDB SYNC (the server's default is lazy: memory would be freed, and CPU
        spent, in the background during the next measurement)."""
        for db in dbs or (BROKER_DB, bench_app.COUNTER_DB):
            self.client(db).execute_command("FLUSHDB", "SYNC")

    def flushall(self) -> None:
        """FLUSHALL SYNC, then wait until no lazily freed object is pending."""
        self.client().execute_command("FLUSHALL", "SYNC")
        self._snapshots.clear()
        deadline = time.monotonic() + 30
        while int(self.info("memory").get("lazyfree_pending_objects", 0)) and \
                time.monotonic() < deadline:
            time.sleep(0.05)

    def key_bytes(self, db: int = BROKER_DB) -> int:
        """Sum of ``MEMORY USAGE`` over every key of ``db`` (a cross-check of used_memory)."""
        c = self.client(db)
        keys = list(c.scan_iter(count=1000))
        with c.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.execute_command("MEMORY", "USAGE", key, "SAMPLES", "0")
            return sum(int(n or 0) for n in pipe.execute())

    # -- subprocesses -----------------------------------------------------------------
    def env(self, mode: str, **extra: Any) -> dict[str, str]:
        env = dict(self.env_base)
        env["BENCH_MODE"] = mode
        env["BENCH_BROKER_URL"] = self.server.url(scheme=SCHEMES[mode], db=BROKER_DB)
        for key, value in extra.items():
            env[f"BENCH_{key.upper()}"] = str(value)
        return env

    def worker(self, mode: str, pool: str, concurrency: int, **extra: Any) -> Proc:
        """A ``celery -A bench.app worker`` (not started)."""
        n = next(_ids)
        argv = [sys.executable, "-m", "celery", "-A", "bench.app", "worker",
                "-P", pool, "-c", str(concurrency), "-n", f"bench{n}-{mode}@%h",
                *WORKER_FLAGS]
        return Proc(argv, self.env(mode, **extra),
                    self.log_dir / f"worker-{n:03d}-{mode}-{pool}.log")

    def workers(self, mode: str, pool: str, concurrency: int, processes: int,
                **extra: Any) -> Proc | ProcGroup:
        """``processes`` workers of ``pool -c concurrency`` (not started); one is a Proc."""
        if processes == 1:
            return self.worker(mode, pool, concurrency, **extra)
        return ProcGroup([self.worker(mode, pool, concurrency, **extra)
                          for _ in range(processes)])

    def dramatiq_worker(self, processes: int | None = None, threads: int | None = None,
                        green: bool = False, **extra: Any) -> Proc:
        """A ``dramatiq bench.dramatiq_app`` worker (not started): by default its processes
        x threads as stated in ``bench.dramatiq_app``; ``green``: ``dramatiq-gevent``, its
        threads greenlets."""
        from bench import dramatiq_app

        n = next(_ids)
        command = "dramatiq-gevent" if green else "dramatiq"
        script = Path(sys.executable).with_name(command)
        argv = [str(script) if green else sys.executable, *(() if green else ("-m", "dramatiq")),
                "bench.dramatiq_app",
                "--processes", str(processes or dramatiq_app.PROCESSES),
                "--threads", str(threads or dramatiq_app.THREADS)]
        return Proc(argv, self.env(DRAMATIQ, **extra),
                    self.log_dir / f"worker-{n:03d}-{command}.log")

    def run_client(self, mode: str, args: list[str], timeout: float,
                   **extra: Any) -> dict[str, Any]:
        """Run ``python -m bench.client ARGS`` to completion and parse its JSON."""
        log_path = self.log_dir / f"client-{next(_ids):03d}-{mode}-{args[0]}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            try:
                done = subprocess.run(
                    [sys.executable, "-m", "bench.client", *args], cwd=REPO_ROOT,
                    env=self.env(mode, **extra), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=log, timeout=timeout, check=False)
            except subprocess.TimeoutExpired:
                raise BenchError(f"client {args} timed out after {timeout:.0f}s; "
                                 f"log {log_path}") from None
        if done.returncode != 0:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            raise BenchError(f"client {args} exited {done.returncode}; log {log_path}:\n{tail}")
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    def wait_ready(self, worker: Proc, timeout: float = 60.0) -> None:
        """Wait until the worker's ``worker_ready`` handler announced its pid."""
        deadline = time.monotonic() + timeout
        while not self.counter.sismember(bench_app.READY_KEY, str(worker.pid)):
            if not worker.alive():
                raise BenchError(f"worker exited early; log {worker.log_path}:\n"
                                 f"{worker.log_tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"worker not ready in {timeout:.0f}s; log {worker.log_path}:"
                                 f"\n{worker.log_tail()}")
            time.sleep(0.02)

    def wait_count(self, worker: Proc | ProcGroup, n: int, timeout: float, poll: float = 0.01,
                   on_first: Callable[[int], None] | None = None) -> tuple[float, float]:
        """Wait until ``n`` jobs are counted; returns (first seen, all done) perf_counter
        stamps. ``on_first(done)`` runs when the first completions are seen."""
        deadline = time.monotonic() + timeout
        first = 0.0
        while True:
            done = int(self.counter.get(bench_app.COUNTER_KEY) or 0)
            now = time.perf_counter()
            if done and not first:
                first = now
                if on_first is not None:
                    on_first(done)
            if done >= n:
                return first, now
            if not worker.alive():
                raise BenchError(f"worker exited with {done}/{n} done; log {worker.log_path}:"
                                 f"\n{worker.log_tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"only {done}/{n} jobs done in {timeout:.0f}s; "
                                 f"log {worker.log_path}:\n{worker.log_tail()}")
            time.sleep(poll)

    # -- snapshots --------------------------------------------------------------------
    def snapshot(self, name: str) -> int:
        """Copy every key of the broker db into snapshot ``name`` (a spare database of
        its own, reused when the name is); returns the key count."""
        dst = self._snapshots.get(name)
        if dst is None:
            free = [db for db in SNAPSHOT_DBS if db not in self._snapshots.values()]
            if not free:
                raise BenchError(f"no spare database left for snapshot {name!r}")
            dst = self._snapshots[name] = free[0]
        src = self.client(BROKER_DB)
        self.flush(dst)
        keys = list(src.scan_iter(count=1000))
        with src.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.execute_command("COPY", key, key, "DB", dst)
            pipe.execute()
        return len(keys)

    def restore(self, name: str) -> None:
        """Empty the broker and counter dbs, then copy snapshot ``name`` back."""
        self.flush()
        src = self.client(self._snapshots[name])
        keys = list(src.scan_iter(count=1000))
        with src.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.execute_command("COPY", key, key, "DB", BROKER_DB, "REPLACE")
            pipe.execute()

    def drop_snapshots(self) -> None:
        """Free every snapshot (before workloads that measure the server's memory)."""
        if self._snapshots:
            self.flush(*self._snapshots.values())
            self._snapshots.clear()


class CommandCounter:
    """Counts the commands clients send, by name, from a MONITOR connection in a thread.

    Commands run inside Lua scripts (``[0 lua]``) are not counted: they are not sent.
    """

    def __init__(self, server: RedisServer) -> None:
        self._server = server
        self._stop = threading.Event()
        self.sent: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._sock: socket.socket | None = None

    def __enter__(self) -> CommandCounter:
        sock = socket.create_connection((self._server.host, self._server.port), timeout=5)
        if self._server.password:
            sock.sendall(_resp("AUTH", self._server.password))
            if not sock.recv(64).startswith(b"+OK"):
                raise BenchError("MONITOR connection: AUTH failed")
        sock.sendall(_resp("MONITOR"))
        sock.settimeout(0.2)
        self._sock = sock
        self._thread.start()
        return self

    def _run(self) -> None:
        assert self._sock is not None
        buf = b""
        while not self._stop.is_set():
            try:
                chunk = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            *lines, buf = buf.split(b"\r\n")
            for line in lines:
                self._count(line)

    def _count(self, line: bytes) -> None:
        # +1700000000.123456 [0 127.0.0.1:40000] "cmd" "arg" ...   (+OK answers MONITOR)
        if not line.startswith(b"+") or b"] " not in line or b" lua]" in line:
            return
        name = line.split(b"] ", 1)[1].split(b" ", 1)[0].strip(b'"').decode().lower()
        self.sent[name] = self.sent.get(name, 0) + 1

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)
        if self._sock is not None:
            self._sock.close()


def _resp(*parts: str) -> bytes:
    out = [f"*{len(parts)}\r\n".encode()]
    for p in parts:
        b = p.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def counts_delta(before: Mapping[str, int], after: Mapping[str, int],
                 skip: tuple[str, ...] = ()) -> dict[str, int]:
    """Per-command call deltas, without the harness's own commands in ``skip``."""
    out = {}
    for name, calls in after.items():
        d = calls - before.get(name, 0)
        if d > 0 and not any(name == s or name.startswith(s + "|") for s in skip):
            out[name] = d
    return out
