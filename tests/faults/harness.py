"""One fault scenario against one transport: start, enqueue, break things, settle, count.

A run starts a fresh server (AOF on, the scenario's ``appendfsync``), a TCP proxy in
front of it, and ``pools`` real worker pools, prefork unless the scenario names
another execution pool (the last one reaches Redis through the proxy, so it can be cut
off). A producer thread enqueues ``jobs`` jobs
with unique ids (a ``backlog`` share at once, the rest paced over the fault
window), while a fault thread injects the
scenario's faults every ``interval`` seconds. Then the run settles: it waits until
every accepted job is done, or until nothing has finished for ``settle`` seconds.

Counting comes only from the append-only record the jobs write (``tests.faults.app``):

- **accepted**: ``apply_async`` returned; **refused**: it raised (the caller knows)
- **lost** = accepted jobs never done and not in the dead set (ours: a job running in
  every pool the faults killed goes there past ``max_recoveries``, as a poison pill);
  **duplicates** = starts - distinct jobs started
- **publish-retry duplicates**: extra starts of a job that no redelivery explains
  (both copies were fresh messages): Kombu's publish retry stored it twice
- **in flight at a fault**: jobs the hit pool owned then (ours: its in-flight record;
  stock: ``unacked`` of the whole server for server faults, started-not-done for pools)
- **recovery** per fault: from the fault until every job running on the hit pool (or
  anywhere, for server faults) at that moment is done by somebody (ours: or is in the
  dead set, a poison pill past ``max_recoveries``).
- **resumed** per silent-connection fault: from the moment the connection went silent
  until the same kind of request (fetch, ack, enqueue) was answered on another
  connection: the client noticed and went on.
- **connections** per fault (one server): connections the server accepted from the
  fault until the next one; **reconnects**: consumer reconnects in the pools' logs.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis

from celery_ext.admin.overview import State
from celery_ext.config import DEFAULT_NAMESPACE
from celery_ext.store import scripts as _scripts
from celery_ext.store.connections import cluster_client, cluster_config
from celery_ext.store.dead_set import split_record
from celery_ext.store.keys import Keys
from celery_ext.testing.server import ClusterGroup, RedisServer, SentinelGroup
from tests.faults.app import job_names, make_app
from tests.faults.proxy import Proxy
from tests.faults.scenarios import Scenario
from tests.workers import WorkerProcess

MODES = ("stock", "ours")
KEYS = Keys(DEFAULT_NAMESPACE)
CLUSTER_KEYS = Keys(DEFAULT_NAMESPACE, cluster=True)
SCHEMES = {"stock": "redis", "ours": "celery-ext"}

#: Celery's worker_prefetch_multiplier (the faults app keeps the default).
PREFETCH_MULTIPLIER = 4

#: Fault kinds; a scenario is a list of them, injected in turn.
POOL_FAULTS = ("kill_main", "kill_child", "sigterm", "sigstop", "partition",
               "fetch_reply_lost", "cut", "ack_lost", "fetch_silent", "ack_silent")
SERVER_FAULTS = ("redis_kill", "debug_sleep", "client_pause", "oom", "cluster_failover")
#: Faults of the producer's connection (it reaches Redis through a proxy of its own).
PRODUCER_FAULTS = ("publish_cut", "publish_silent")
#: Faults that leave a connection half-open (see ``Proxy.freeze_on``).
SILENT_FAULTS = ("fetch_silent", "ack_silent", "publish_silent")
#: What the producer's enqueue request contains: the command (stock) or the script.
ENQUEUE_REQUEST = {"stock": b"LPUSH", "ours": _scripts.sha("enqueue").encode()}


#: The Sentinel master name of sentinel scenarios, and ours' replicas to WAIT for.
MASTER_NAME = "faults"
WAIT_REPLICAS = 1


@dataclass
class Options:
    """Sizes and timings of a run; the CLI and the CI test shrink them."""

    jobs: int = 5000
    faults: int = 4               # faults injected per scenario (soak: per kind)
    interval: float = 4.0         # seconds from one fault to the next
    warmup: float = 1.5           # seconds of flow before the first fault
    pools: int = 3
    concurrency: int = 2
    short_seconds: tuple[float, float] = (0.005, 0.03)
    long_share: float = 0.02      # jobs that take long_seconds instead
    long_seconds: tuple[float, float] = (0.5, 1.5)
    backlog: float = 0.5          # share of the jobs enqueued at once, before the faults
    countdown_share: float = 0.1  # jobs sent with a countdown of up to countdown_max
    countdown_max: float = 2.0
    settle: float = 20.0          # give up after this long without a job finishing
    max_settle: float = 300.0     # and after this long in all
    # Our pools' timings (CELERY_EXT_*): recovery is bounded by dead_after + reap.
    heartbeat_interval: float = 0.5
    dead_after: float = 3.0
    reap_interval: float = 1.0
    #: Seconds Redis stalls at a redis_stall fault (DEBUG SLEEP, CLIENT PAUSE); 0 = twice
    #: dead_after.
    stall: float = 0.0
    seed: int = 1
    #: Every job takes this many ms (the scale soak's near-no-op jobs); negative: the
    #: mix above.
    job_ms: float = -1.0
    #: The scale soak's producer processes, and how many jobs they keep sent and not
    #: yet done at most.
    producers: int = 2
    max_queued: int = 5000


@dataclass
class Fault:
    kind: str
    at: float                      # time.time() when injected
    pool: str | None               # hostname of the hit pool (pool faults)
    in_flight: int                 # jobs the hit pool (or server) owned then
    running: list[str] = field(default_factory=list)  # jobs running there then
    owned: list[str] = field(default_factory=list)    # ours: job ids in its in-flight record
    recovery: float | None = None  # seconds until all of `running` were done
    #: Silent-connection faults: seconds until the hit client was answered again.
    resumed: float | None = None
    #: Connections the server accepted from this fault until the next (one server).
    connections: int | None = None


@dataclass
class Kill:
    """cluster_failover: one master killed. ``read_at``: when the pools' in-flight records
    were read, just before ``at``, the kill; ``names``: its job queues; ``promoted_s``:
    seconds from the kill until a replica was promoted."""

    read_at: float
    at: float
    names: list[str]
    promoted_s: float
    fault: Fault


@dataclass
class Result:
    scenario: str
    mode: str
    accepted: int = 0
    refused: int = 0
    refused_error: str = ""
    done: int = 0
    lost: int = 0
    lost_sample: list[str] = field(default_factory=list)
    #: ours: accepted jobs in the dead set (accounted for, not lost), by reason; a job
    #: that was running in every pool the faults killed is a poison pill by design
    #: (``max_recoveries``).
    dead: int = 0
    dead_reasons: dict[str, int] = field(default_factory=dict)
    starts: int = 0
    duplicates: int = 0
    in_flight_at_faults: int = 0
    #: ours: jobs run twice that no hit pool (or, for server faults, no pool) owned at
    #: a fault; promise 2 says there are none.
    unexplained_duplicates: int | None = None
    #: extra starts of jobs stored twice: both copies were fresh messages (not
    #: redelivered), so Kombu's publish retry sent the job again after the first write
    #: had reached Redis (a fault inside the round trip).
    publish_retry_duplicates: int = 0
    #: ours: dead pools the reapers declared (from the worker logs).
    pools_reaped: int | None = None
    faults: list[Fault] = field(default_factory=list)
    recovery_median: float | None = None
    recovery_max: float | None = None
    unrecovered_faults: int = 0
    #: Silent-connection faults: the longest time to be answered again, and how many
    #: faults were never answered again within their interval.
    resumed_max: float | None = None
    unresumed_faults: int = 0
    #: Consumer reconnects the pools logged ("Connection to broker lost").
    reconnects: int = 0
    crashed_pools: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    #: Why this run did not run (stock on a cluster); its figures mean nothing then.
    not_run: str = ""
    #: cluster_failover: per fault, the killed master's job queues, seconds until a
    #: replica was promoted, and until a job of those queues fetched after the kill (no
    #: pool held it then) was done: its queues flow again through the promoted master.
    failovers: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def recovery(fault_at: float, running: set[str],
             lines: list[tuple[str, str, int, float]]) -> float | None:
    """Seconds from a fault until every job of ``running`` (running at the fault) was
    done, from the record's ``lines``; None while one is not.

    The run each job had at the fault began at its last start before it, and the first
    end after that start ends it. An end stamped before the fault is a job that finished
    as the fault struck: its worker wrote the line after the harness read the record
    (seen under load), so it counts as done at the fault."""
    if not running:
        return 0.0
    began: dict[str, float] = {}
    for kind, job, _, at in lines:
        if kind == "S" and job in running and at <= fault_at:
            began[job] = at
    ends: dict[str, float] = {}
    for kind, job, _, at in lines:
        if kind == "D" and job in running and job not in ends \
                and at >= began.get(job, fault_at):
            ends[job] = max(at, fault_at)
    if len(ends) < len(running):
        return None
    return round(max(ends.values()) - fault_at, 2)


@dataclass
class Record:
    """The parsed append-only record: (kind, job, pid, time) per line, and how often
    each job started from a fresh (not redelivered) message."""

    lines: list[tuple[str, str, int, float]]
    first_starts: Counter[str] = field(default_factory=Counter)

    @classmethod
    def read(cls, path: Path) -> Record:
        lines = []
        first: Counter[str] = Counter()
        try:
            text = path.read_text()
        except FileNotFoundError:
            text = ""
        for raw in text.splitlines():
            parts = raw.split()
            if len(parts) in (4, 5):
                lines.append((parts[0], parts[1], int(parts[2]), float(parts[3])))
                if parts[0] == "S" and parts[4:] == ["first"]:
                    first[parts[1]] += 1
        return cls(lines, first)

    def done_ids(self) -> set[str]:
        return {job for kind, job, _, _ in self.lines if kind == "D"}

    def running_at(self, t: float, pids: set[int] | None) -> list[str]:
        """Jobs started before ``t`` (by ``pids``, if given) and not done by then."""
        open_: dict[tuple[str, int], int] = Counter()
        for kind, job, pid, at in self.lines:
            if at > t or (pids is not None and pid not in pids):
                continue
            open_[(job, pid)] += 1 if kind == "S" else -1
        return sorted({job for (job, _), n in open_.items() if n > 0})


class Run:
    """One scenario, one mode. ``run()`` returns the :class:`Result`."""

    def __init__(self, scenario: Scenario, mode: str, options: Options, workdir: Path,
                 log: Callable[[str], None] = print) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.scenario = scenario
        self.mode = mode
        self.opt = options
        self.dir = workdir / f"{scenario.name}-{mode}"
        self.record_path = self.dir / "record.log"
        self.log = log
        self.rng = random.Random(options.seed)
        self.result = Result(scenario.name, mode)
        self.server = RedisServer(data_dir=self.dir / "redis",
                                  appendfsync=scenario.appendfsync,
                                  extra_args=["--enable-debug-command", "yes"])
        self.group = SentinelGroup(master_name=MASTER_NAME) if scenario.sentinel else None
        self.cluster = ClusterGroup(masters=3, replicas=1) if scenario.cluster else None
        self.names = job_names(scenario.names)
        #: Job id -> its job name, and when its apply_async returned (time.time()).
        self._name_of: dict[str, str] = {}
        self._accepted_at: dict[str, float] = {}
        self._kills: list[Kill] = []
        self.proxy: Proxy | None = None
        self.producer_proxy: Proxy | None = None  # publish_cut only
        self.pools: list[WorkerProcess] = []
        self._retired: list[WorkerProcess] = []  # stopped or killed on purpose
        self._lock = threading.Lock()
        self._producer_done = threading.Event()
        #: A fault that needs the proxied pool to hold jobs asks the producer to send
        #: the next jobs of its schedule at once (see ``_produce``).
        self._hurry = threading.Event()
        self._accepted: list[str] = []
        self._errors: list[str] = []

    # -- set-up -----------------------------------------------------------------------
    def _url(self, via_proxy: bool, proxy: Proxy | None = None) -> str:
        if self.cluster is not None:  # a seed node; the cluster option does the rest
            return self.cluster.url(scheme=SCHEMES[self.mode])
        if self.group is not None:
            return self.group.url(scheme="sentinel" if self.mode == "stock" else
                                  "celery-ext+sentinel")
        proxy = proxy or self.proxy
        assert proxy is not None
        port = proxy.port if via_proxy else self.server.port
        return f"{SCHEMES[self.mode]}://127.0.0.1:{port}/0"

    def _env(self) -> dict[str, str]:
        return {
            "FAULTS_MODE": self.mode,
            "FAULTS_RECORD": str(self.record_path),
            "CELERY_EXT_HEARTBEAT_INTERVAL": str(self.opt.heartbeat_interval),
            "CELERY_EXT_DEAD_AFTER": str(self.opt.dead_after),
            "CELERY_EXT_REAP_INTERVAL": str(self.opt.reap_interval),
            "CELERY_EXT_NO_INSTALL": "1" if self.scenario.dropin else "0",
            "FAULTS_ACKS_LATE": "1" if self.scenario.acks_late else "0",
            **({"FAULTS_MASTER_NAME": MASTER_NAME} if self.group is not None else {}),
            **({"FAULTS_WAIT_REPLICAS": str(WAIT_REPLICAS)}
               if self.group is not None and self.mode == "ours" else {}),
            **({"FAULTS_CLUSTER": "1"} if self.cluster is not None else {}),
            "FAULTS_NAMES": str(len(self.names)),
        }

    def _transport_options(self) -> dict[str, Any] | None:
        if self.cluster is not None:
            return {"cluster": True}
        if self.group is None:
            return None
        if self.mode == "stock":
            return {"master_name": MASTER_NAME}
        return {"master_name": MASTER_NAME, "wait_replicas": WAIT_REPLICAS}

    def _new_pool(self, slot: int) -> WorkerProcess:
        via_proxy = slot == self.opt.pools - 1
        pool, concurrency = self.scenario.pool or ("prefork", self.opt.concurrency)
        if via_proxy and self.scenario.proxied_pool is not None:
            pool, concurrency = self.scenario.proxied_pool
        worker = WorkerProcess(
            "tests.faults.app", self._url(via_proxy), pool=pool,
            concurrency=concurrency, env=self._env(), log_dir=self.dir / "logs",
            hostname=f"p{slot}-{len(self.pools) + len(self._retired)}@%h")
        worker.slot = slot  # type: ignore[attr-defined]
        return worker

    def _start_pools(self, workers: list[WorkerProcess]) -> None:
        for w in workers:
            w.start(wait_ready=False)
        for w in workers:
            w.wait_for_log(w.ready_pattern or "", timeout=60)

    # -- the run ----------------------------------------------------------------------
    def run(self) -> Result:
        shutil.rmtree(self.dir, ignore_errors=True)  # no AOF or record of an earlier run
        self.dir.mkdir(parents=True)
        started = time.monotonic()
        if self.mode == "stock" and self.scenario.stock_not_run:
            self.result.not_run = self.scenario.stock_not_run
            self.result.notes.append(f"not run: {self.scenario.stock_not_run}")
            return self.result
        if self.cluster is not None:
            self.cluster.start()
        elif self.group is not None:
            self.group.start()
        else:
            self.server.start()
            self.proxy = Proxy(("127.0.0.1", self.server.port)).start()
        if any(kind in PRODUCER_FAULTS for kind in self.scenario.kinds):
            self.producer_proxy = Proxy(("127.0.0.1", self.server.port)).start()
        try:
            self.pools = [self._new_pool(i) for i in range(self.opt.pools)]
            self._start_pools(self.pools)
            producer = threading.Thread(target=self._produce, name="producer", daemon=True)
            producer.start()
            time.sleep(self.opt.warmup)
            self._inject_faults()
            # A client that waits forever for a silent connection's reply (stock has no
            # socket timeout) never returns from apply_async: the run goes on without it.
            producer.join(timeout=self.opt.warmup + len(self._fault_plan()) * self._interval
                          + self.opt.settle)
            if producer.is_alive():
                self.result.notes.append(
                    f"the producer hung: {len(self._accepted)} of {self.opt.jobs} jobs sent")
            self._settle()
            self._count()
            self._note_reconciles()
        finally:
            self._teardown()
        self.result.seconds = round(time.monotonic() - started, 1)
        return self.result

    @property
    def _interval(self) -> float:
        return max(self.opt.interval, self.scenario.min_interval)

    def _fault_plan(self) -> list[str]:
        kinds = list(self.scenario.kinds)
        plan: list[str] = []
        for kind in kinds:
            if kind == "redis_stall":
                plan += ["debug_sleep", "client_pause"]
            else:
                plan.append(kind)
        if self.scenario.name == "soak":
            return plan * self.opt.faults
        return [plan[i % len(plan)] for i in range(self.opt.faults)]

    def _produce(self) -> None:
        """Enqueue every job, paced over the fault window, counting refusals."""
        app = make_app(self.mode, self._url(self.producer_proxy is not None,
                                            self.producer_proxy),
                       install=not self.scenario.dropin, acks_late=self.scenario.acks_late,
                       transport_options=self._transport_options(), names=len(self.names))
        tasks = [app.tasks[name] for name in self.names]
        countdowns = self.opt.countdown_share if self.scenario.countdowns else 0.0
        window = self.opt.warmup + len(self._fault_plan()) * self._interval
        burst = int(self.opt.jobs * self.opt.backlog)
        gap = window / max(1, self.opt.jobs - burst)
        t0 = time.monotonic()
        ahead = 0  # jobs still to send at once, ahead of the schedule
        for i in range(self.opt.jobs):
            job_id = f"job-{i:06d}"
            if self.rng.random() < self.opt.long_share:
                seconds = self.rng.uniform(*self.opt.long_seconds)
            else:
                seconds = self.rng.uniform(*(self.scenario.short_seconds
                                             or self.opt.short_seconds))
            options: dict[str, Any] = {"task_id": job_id}
            if self.rng.random() < countdowns:
                options["countdown"] = round(self.rng.uniform(0, self.opt.countdown_max), 3)
            task = tasks[i % len(tasks)]
            try:
                task.apply_async((job_id, round(seconds, 4)), **options)
            except Exception as exc:  # the caller learns: this job was never accepted
                self._errors.append(f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
            else:
                self._accepted.append(job_id)
                self._name_of[job_id] = task.name
                self._accepted_at[job_id] = time.time()
            delay = t0 + (i + 1 - burst) * gap - time.monotonic()
            if ahead:
                ahead -= 1
            elif i >= burst and delay > 0 and self._hurry.wait(delay):
                # Pull the next jobs of the schedule forward, enough to fill every pool's
                # prefetch: the pools that reach Redis directly win the race for a trickle
                # of jobs, the proxied pool only gets jobs they have no room for.
                self._hurry.clear()
                ahead = self.opt.pools * self.opt.concurrency * PREFETCH_MULTIPLIER
        app.close()
        self._producer_done.set()

    def _inject_faults(self) -> None:
        for kind in self._fault_plan():
            t_next = time.monotonic() + self._interval
            before = self._connections_received()
            try:
                fault = getattr(self, f"_fault_{kind}")()
            except Exception as exc:
                self.result.notes.append(f"{kind}: fault injection failed: {exc!r}")
                fault = None
            if fault is not None:
                self.result.faults.append(fault)
                self.log(f"  {self.scenario.name}/{self.mode}: {kind} "
                         f"{fault.pool or 'server'} in flight {fault.in_flight}"
                         + (f", answered again after {fault.resumed} s"
                            if kind in SILENT_FAULTS else ""))
            time.sleep(max(0.0, t_next - time.monotonic()))
            after = self._connections_received()
            if fault is not None and before is not None and after is not None:
                fault.connections = after - before

    def _connections_received(self) -> int | None:
        """Connections the one server has accepted so far (None: no single server up)."""
        if self.group is not None or self.cluster is not None:
            return None
        try:
            with self.server.client(socket_timeout=5) as client:
                return int(client.info("stats")["total_connections_received"])
        except redis.RedisError:
            return None

    def _settle(self) -> None:
        """Wait until all accepted jobs are done, or nothing finishes for ``settle`` s."""
        deadline = time.monotonic() + self.opt.max_settle
        last_done, last_change = -1, time.monotonic()
        while time.monotonic() < deadline:
            done = self._done_count()
            if done >= len(self._accepted):
                return
            if done != last_done:
                last_done, last_change = done, time.monotonic()
            elif time.monotonic() - last_change > self.opt.settle:
                self.result.notes.append(
                    f"gave up waiting: nothing finished for {self.opt.settle:.0f} s")
                return
            self._settle_pause()
        self.result.notes.append(f"gave up waiting after {self.opt.max_settle:.0f} s")

    def _done_count(self) -> int:
        """Accepted jobs the record shows done (read whole: a few thousand lines)."""
        return len(Record.read(self.record_path).done_ids() & set(self._accepted))

    def _settle_pause(self) -> None:
        """Between two looks at the record while settling."""
        time.sleep(0.2)

    def _count(self) -> None:
        rec = Record.read(self.record_path)
        r = self.result
        accepted = set(self._accepted)
        done = rec.done_ids()
        starts = [job for kind, job, _, _ in rec.lines if kind == "S"]
        r.accepted, r.refused = len(accepted), len(self._errors)
        r.refused_error = self._errors[0] if self._errors else ""
        r.done = len(done & accepted)
        dead = self._dead_jobs() if self.mode == "ours" else {}
        dead = {job: why for job, why in dead.items() if job in accepted and job not in done}
        r.dead, r.dead_reasons = len(dead), dict(Counter(dead.values()))
        lost = sorted(accepted - done - set(dead))
        r.lost, r.lost_sample = len(lost), lost[:5]
        r.starts = len(starts)
        r.duplicates = len(starts) - len(set(starts))
        stored_twice = {job for job, n in rec.first_starts.items() if n > 1}
        r.publish_retry_duplicates = sum(rec.first_starts[job] - 1 for job in stored_twice)
        for kill in self._kills:
            self._add_fetched_before_kill(rec, kill)
        if self.mode == "ours":
            twice = {job for job, n in Counter(starts).items() if n > 1}
            owned = {job for f in r.faults for job in f.owned}
            r.unexplained_duplicates = len(twice - owned - stored_twice)
            r.pools_reaped = sum(
                int(m.group(1)) for w in self.pools + self._retired if w.started
                for m in re.finditer(r"reaped (\d+) dead worker pool", w.log_text()))
        r.in_flight_at_faults = sum(f.in_flight for f in r.faults)
        for f in r.faults:
            # A poison pill ends in the dead set, not done: the others say when it was over.
            f.recovery = recovery(f.at, set(f.running) - set(dead), rec.lines)
        silent = [f for f in r.faults if f.kind in SILENT_FAULTS]
        resumed = [f.resumed for f in silent if f.resumed is not None]
        r.resumed_max = max(resumed) if resumed else None
        r.unresumed_faults = len(silent) - len(resumed)
        r.reconnects = sum(w.log_text().count("Connection to broker lost")
                           for w in self.pools + self._retired if w.started)
        recoveries = [f.recovery for f in r.faults if f.recovery is not None]
        r.unrecovered_faults = sum(1 for f in r.faults if f.recovery is None)
        if recoveries:
            r.recovery_median = round(statistics.median(recoveries), 2)
            r.recovery_max = round(max(recoveries), 2)
        r.crashed_pools = sum(1 for w in self.pools if w.started and not w.alive)
        for kill in self._kills:
            # A job of the killed master's queues that no pool held at the kill and that
            # started after it was fetched from the promoted master.
            owned = set(kill.fault.owned)
            fetched_after = {job for kind, job, _, t in rec.lines if kind == "S"
                             and t > kill.at and self._name_of.get(job) in kill.names
                             and job not in owned}
            done_at = [t for kind, job, _, t in rec.lines
                       if kind == "D" and t > kill.at and job in fetched_after]
            r.failovers.append({
                "job_queues": len(kill.names), "promoted_s": round(kill.promoted_s, 2),
                "flowing_s": round(min(done_at) - kill.at, 2) if done_at else None})

    def _add_fetched_before_kill(self, rec: Record, kill: Kill) -> None:
        """Jobs of the killed master's queues that started between the read of the
        in-flight records and the promotion were fetched from it before the kill (no
        other master holds those queues): the pools owned them at the kill too."""
        until = kill.at + kill.promoted_s
        owned = set(kill.fault.owned)
        extra = sorted({job for kind, job, _, t in rec.lines
                        if kind == "S" and kill.read_at <= t <= until
                        and self._name_of.get(job) in kill.names and job not in owned})
        kill.fault.owned += extra
        kill.fault.in_flight += len(extra)

    def _dead_jobs(self) -> dict[str, str]:
        """Job id -> reason of every job in our dead set (every job queue's, on a cluster)."""
        out: dict[str, str] = {}
        if self.cluster is not None:
            with self._cluster_client() as rc, rc.pipeline() as pipe:
                for name in self.names:
                    pipe.hvals(CLUSTER_KEYS.of(name).dead_jobs)
                raws = [raw for values in pipe.execute() for raw in values]
        else:
            raws = self._admin().hvals(KEYS.dead_jobs)
        for raw in raws:
            meta, _queue, payload = split_record(raw)
            try:
                out[json.loads(payload)["headers"]["id"]] = str(meta.get("reason", ""))
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def _teardown(self) -> None:
        """Everything is counted by now: SIGKILL the pools, whose warm shutdown (seconds
        for a gevent pool) would show nothing the run reports, and their process groups."""
        threads = [threading.Thread(target=w.stop, args=(signal.SIGKILL, 10))
                   for w in self.pools + self._retired if w.started]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for proxy in (self.proxy, self.producer_proxy):
            if proxy is not None:
                proxy.stop()
        self.server.stop()
        if self.group is not None:
            self.group.stop()
        if self.cluster is not None:
            self.cluster.stop()

    # -- fault helpers --------------------------------------------------------------
    def _admin(self, timeout: float = 30) -> redis.Redis:
        if self.group is not None:  # the primary of the moment
            primary = self.group.master_server()
            if primary is None:
                raise RuntimeError("the sentinels name no primary of ours")
            return primary.client(socket_timeout=timeout)
        return self.server.client(socket_timeout=timeout)

    def _pick_pool(self) -> WorkerProcess:
        live = [w for w in self.pools if w.alive]
        return self.rng.choice(live)

    def _pids(self, worker: WorkerProcess) -> set[int]:
        try:
            main = psutil.Process(worker.pid)
            return {worker.pid, *(c.pid for c in main.children(recursive=True))}
        except psutil.NoSuchProcess:
            return {worker.pid}

    def _cluster_client(self) -> Any:
        """A RedisCluster client of the cluster (seeded by every running node)."""
        assert self.cluster is not None
        config = cluster_config([self.cluster.url()], {"cluster": True})
        assert config is not None
        return cluster_client(config, {"socket_timeout": 30.0})

    def _owned_on_cluster(self, pid: int | None) -> list[str]:
        """``_owned`` on a cluster: a pool's in-flight record is one per job queue, in
        that queue's copy; the pools' registrations are in the home copy."""
        home = CLUSTER_KEYS.home
        with self._cluster_client() as rc:
            pools = [p.decode() for p in rc.zrange(home.pools, 0, -1)]
            pids = [int(rc.hget(home.pool(p), "pid") or 0) for p in pools]
            pools = [p for p, n in zip(pools, pids, strict=True) if pid is None or n == pid]
            with rc.pipeline() as pipe:
                for name in self.names:
                    for pool in pools:
                        pipe.hvals(CLUSTER_KEYS.of(name).inflight(pool))
                raws = [raw for values in pipe.execute() for raw in values]
        return [job for job in map(_job_id, raws) if job]

    def _owned(self, pid: int | None) -> list[str]:
        """Ours: ids of the jobs in the in-flight record of the pool whose main process
        is ``pid`` (every pool's if None)."""
        if self.cluster is not None:
            return self._owned_on_cluster(pid)
        owned: list[str] = []
        with self._admin() as client:
            for info in State(client).worker_pools():
                if pid is not None and info["pid"] != pid:
                    continue
                for raw in client.hvals(KEYS.inflight(info["pool_id"])):
                    payload = raw.decode("utf-8", "replace").split("\n", 1)[-1]
                    try:
                        owned.append(str(json.loads(payload)["headers"]["id"]))
                    except (ValueError, KeyError, TypeError):
                        continue
        return owned

    def _pool_in_flight(self, worker: WorkerProcess,
                        pids: set[int] | None = None) -> tuple[int, list[str]]:
        """Jobs ``worker`` owns now: ours from its in-flight record; stock from the
        record (started, not done) since Kombu's unacked hash is not per worker."""
        if self.mode == "ours":
            owned = self._owned(worker.pid)
            return len(owned), owned
        running = Record.read(self.record_path).running_at(time.time(),
                                                           pids or self._pids(worker))
        return len(running), []

    def _server_in_flight(self) -> tuple[int, list[str]]:
        if self.mode == "ours":
            owned = self._owned(None)
            return len(owned), owned
        with self._admin() as client:
            return int(client.hlen("unacked")), []

    def _pool_fault(self, kind: str, worker: WorkerProcess,
                    pids: set[int] | None = None) -> Fault:
        pids = pids or self._pids(worker)
        in_flight, owned = self._pool_in_flight(worker, pids)
        now = time.time()
        running = Record.read(self.record_path).running_at(now, pids)
        return Fault(kind, now, worker.hostname.split("@")[0], in_flight, running, owned)

    def _server_fault(self, kind: str) -> Fault:
        in_flight, owned = self._server_in_flight()
        now = time.time()
        # Jobs running in live pools (orphans of killed pools never finish theirs).
        pids = set().union(*(self._pids(w) for w in self.pools if w.alive))
        running = Record.read(self.record_path).running_at(now, pids)
        return Fault(kind, now, None, in_flight, running, owned)

    def _replace(self, worker: WorkerProcess) -> None:
        """Retire ``worker`` and start a new pool in its slot (same way to Redis)."""
        self.pools.remove(worker)
        self._retired.append(worker)
        new = self._new_pool(worker.slot)  # type: ignore[attr-defined]
        self.pools.append(new)
        self._start_pools([new])

    # -- the faults -------------------------------------------------------------------
    def _fault_kill_main(self) -> Fault:
        worker = self._pick_pool()
        pids = self._pids(worker)
        worker.kill()  # the main process; its prefork children die with it (pdeathsig)
        fault = self._pool_fault("kill_main", worker, pids)  # its records are frozen now
        self._replace(worker)
        return fault

    def _fault_kill_child(self) -> Fault:
        worker = self._pick_pool()
        children = worker.child_pids()
        rec = Record.read(self.record_path)
        busy = [p for p in children if rec.running_at(time.time(), {p})] or children
        if not busy:
            raise RuntimeError(f"{worker.hostname} has no prefork children")
        victim = self.rng.choice(busy)
        in_flight, owned = self._pool_in_flight(worker)
        now = time.time()
        fault = Fault("kill_child", now, worker.hostname.split("@")[0], in_flight,
                      Record.read(self.record_path).running_at(now, {victim}), owned)
        os.kill(victim, signal.SIGKILL)
        return fault

    def _fault_sigterm(self) -> Fault:
        worker = self._pick_pool()
        fault = self._pool_fault("sigterm", worker)
        started = time.monotonic()
        worker.stop(signal.SIGTERM, timeout=30)
        if worker.stop_timed_out:
            # SIGKILLed after 30 s: the reaper then returns what it owned. Its log ends
            # with every thread's stack (Celery's SIGUSR1 handler, sent before the kill).
            self.result.notes.append(
                f"sigterm: {worker.hostname} did not exit in 30 s and was SIGKILLed; "
                f"its log {worker.log_path} ends:\n{worker.log_tail(80)}")
        else:
            self.log(f"  {self.scenario.name}/{self.mode}: {worker.hostname} exited "
                     f"{time.monotonic() - started:.1f} s after SIGTERM")
        self._replace(worker)
        return fault

    def _fault_sigstop(self) -> Fault:
        worker = self._pick_pool()
        os.killpg(worker.pid, signal.SIGSTOP)
        fault = self._pool_fault("sigstop", worker)  # frozen: what it owns cannot change
        time.sleep(self.opt.dead_after * 2)
        os.killpg(worker.pid, signal.SIGCONT)
        return fault

    def _fault_partition(self) -> Fault:
        assert self.proxy is not None
        worker = next(w for w in self.pools if w.slot == self.opt.pools - 1)  # type: ignore[attr-defined]
        self.proxy.stop()
        fault = self._pool_fault("partition", worker)  # cut off: it can fetch no more
        time.sleep(self.opt.dead_after * 2)
        self.proxy.start()
        return fault

    def _fault_publish_cut(self) -> Fault:
        """The producer's next enqueue runs in Redis; its reply is lost with the
        connection. Kombu's publish retry (Celery's default policy) sends it again."""
        proxy = self.producer_proxy
        assert proxy is not None
        lost = proxy.replies_cut
        now = time.time()
        proxy.cut_on_reply(ENQUEUE_REQUEST[self.mode])
        deadline = time.monotonic() + self.opt.interval / 2
        while proxy.replies_cut == lost and time.monotonic() < deadline:
            time.sleep(0.01)
        if proxy.replies_cut == lost:
            proxy.disarm()
            raise RuntimeError("no enqueue went through the producer's proxy")
        return Fault("publish_cut", now, None, 0)

    def _fault_redis_kill(self) -> Fault:
        fault = self._server_fault("redis_kill")
        killed = time.time()
        self.server.kill()
        time.sleep(0.5)
        self.server.start()
        # A job that first started while the server was down was fetched before the kill,
        # maybe after the in-flight records were read: it was owned at the fault too.
        up = time.time()
        late = {job for kind, job, _, at in Record.read(self.record_path).lines
                if kind == "S" and killed <= at <= up}
        fault.owned += sorted(late - set(fault.owned))
        return fault

    def _fault_cluster_failover(self) -> Fault:
        """SIGKILL the master holding the most job queues (a queue's copy is one hash
        slot); its replica is promoted (about 2-3 s with the group's 1 s node timeout).
        The killed node then comes back as a replica of the promoted one and has synced
        before the next fault, so every master has a replica again."""
        cluster = self.cluster
        assert cluster is not None
        held: dict[RedisServer, list[str]] = {}
        for name in self.names:
            copy = CLUSTER_KEYS.of(name)
            held.setdefault(cluster.master_of(copy.queue(name)), []).append(name)
        victim = max(held, key=lambda server: len(held[server]))
        pids = set().union(*(self._pids(w) for w in self.pools if w.alive))
        # What the pools own is read the moment before the kill (the master is gone
        # after it); what they fetched from it in between is added in _count.
        read_at = time.time()
        in_flight, owned = self._server_in_flight()
        killed_at = time.time()
        victim.kill()
        running = Record.read(self.record_path).running_at(killed_at, pids)
        fault = Fault("cluster_failover", killed_at, None, in_flight, running, owned)
        cluster.wait_promoted(victim, timeout=30)
        self._kills.append(Kill(read_at, killed_at, held[victim], time.time() - killed_at,
                                fault))
        victim.start()  # from its nodes.conf: it rejoins as a replica of the promoted one
        deadline = time.monotonic() + 60
        while not (victim in cluster.replica_servers() and cluster.healthy()
                   and _link_up(victim)):
            if time.monotonic() > deadline:
                raise RuntimeError("the killed master did not rejoin as a synced replica")
            time.sleep(0.1)
        return fault

    def _fault_sentinel_failover(self) -> Fault:
        """SIGKILL the primary; the sentinels promote the replica (about 1-3 s), then
        the killed node comes back as a replica of the new primary."""
        assert self.group is not None
        fault = self._server_fault("sentinel_failover")
        old = self.group.master_server()
        assert old is not None
        old.kill()
        deadline = time.monotonic() + 30
        while self.group.master() in (None, (old.host, old.port)):
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinels promoted no replica within 30 s")
            time.sleep(0.05)
        self.group.rejoin(old)
        return fault

    @property
    def _stall(self) -> float:
        return self.opt.stall or self.opt.dead_after * 2

    def _fault_debug_sleep(self) -> Fault:
        fault = self._server_fault("debug_sleep")
        with self._admin(timeout=self._stall + 30) as client:
            client.execute_command("DEBUG", "SLEEP", str(self._stall))
        return fault

    def _fault_client_pause(self) -> Fault:
        fault = self._server_fault("client_pause")
        ms = int(self._stall * 1000)
        with self._admin() as client:
            client.execute_command("CLIENT", "PAUSE", str(ms), "ALL")
        time.sleep(ms / 1000)
        return fault

    def _fault_oom(self) -> Fault:
        fault = self._server_fault("oom")
        with self._admin() as client:
            # Below what is used: every write that grows memory is refused at once.
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory", str(used // 2))
            try:
                time.sleep(self.opt.interval / 2)
            finally:
                client.config_set("maxmemory", "0")
        return fault

    # -- faults inside a round trip, on the proxied pool ------------------------------
    def _proxied(self) -> tuple[Proxy, WorkerProcess]:
        assert self.proxy is not None
        return self.proxy, next(w for w in self.pools
                                if w.slot == self.opt.pools - 1)  # type: ignore[attr-defined]

    def _request(self, what: str) -> bytes:
        """Bytes only the proxied pool's fetch (or ack) request contains: our scripts'
        SHAs; stock fetches with ``BRPOP`` and acks with ``MULTI``, ``ZREM
        unacked_index``, ``HDEL unacked``, ``EXEC`` in one write."""
        if self.mode == "stock":
            return {"fetch": b"BRPOP", "ack": b"ZREM"}[what]
        return _scripts.sha(what).encode()

    def _await_strike(self, count: Callable[[], int], before: int, what: str,
                      within: float | None = None) -> None:
        within = self.opt.interval * 0.75 if within is None else within
        deadline = time.monotonic() + within
        while count() <= before:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {within:.1f} s")
            time.sleep(0.01)

    def _fault_fetch_reply_lost(self) -> Fault:
        """The next fetch of the proxied pool runs in Redis; its connection is cut as
        the reply comes back (stock: the jobs BRPOP popped are gone with it)."""
        proxy, worker = self._proxied()
        fault = self._pool_fault("fetch_reply_lost", worker)
        before = proxy.replies_cut
        proxy.cut_on_reply(self._request("fetch"))
        self._await_strike(lambda: proxy.replies_cut, before, "fetch reply cut")
        return fault

    def _fault_cut(self) -> Fault:
        """Every connection of the proxied pool reset, reconnects refused, for well
        under ``dead_after``: the pool is not declared dead and keeps what it holds."""
        proxy, worker = self._proxied()
        proxy.stop()
        healed = time.monotonic() + min(0.5, self.opt.dead_after / 4)
        fault = self._pool_fault("cut", worker)  # cut off: it can fetch no more
        time.sleep(max(0.0, healed - time.monotonic()))
        proxy.start()
        return fault

    def _fault_ack_lost(self) -> Fault:
        """The next ack of the proxied pool never reaches Redis: its connection is cut
        and new connections are refused for 1 s (the others stay up)."""
        proxy, worker = self._proxied()
        fault = self._pool_fault("ack_lost", worker)
        before = proxy.requests_dropped
        proxy.drop_request(self._request("ack"), refuse_for=1.0)
        self._await_own_strike(worker, lambda: proxy.requests_dropped, before, "ack dropped",
                               within=self.opt.interval * 0.75)
        return fault

    def _await_own_strike(self, worker: WorkerProcess, count: Callable[[], int], before: int,
                          what: str, within: float) -> None:
        """``_await_strike`` for a request the proxied pool sends only when it holds jobs.
        Between bursts the producer sends a trickle of jobs, and every idle pool races
        for each one: the proxied pool, a hop slower, wins few (8 of 138 fetches in a
        measured run, none at all for seconds at times), so it had no ack to strike. The
        other pools' main processes pause (well under dead_after: not declared dead)
        while the producer sends the next jobs of its schedule at once."""
        others = [w for w in self.pools if w is not worker and w.alive]
        armed = time.monotonic()
        for w in others:
            os.kill(w.pid, signal.SIGSTOP)
        try:
            self._hurry.set()
            self._await_strike(count, before, what,
                               within=min(self.opt.dead_after / 4, within / 3))
        except RuntimeError:
            pass  # not yet: go on waiting with every pool running
        finally:
            for w in others:
                os.kill(w.pid, signal.SIGCONT)
        # (The same deadline as every strike: counted from arming.)
        self._await_strike(count, before, what, within=within - (time.monotonic() - armed))

    # -- a connection left half-open --------------------------------------------------
    def _fault_fetch_silent(self) -> Fault:
        """The proxied pool's next fetch runs in Redis; its reply never comes and its
        connection stays open, passing nothing (no reset tells the pool)."""
        proxy, worker = self._proxied()
        fault = self._pool_fault("fetch_silent", worker)
        self._freeze(proxy, self._request("fetch"), True, worker)
        return self._await_answer(proxy, fault)

    def _fault_ack_silent(self) -> Fault:
        """The proxied pool's next ack never reaches Redis and its connection stays
        open, passing nothing."""
        proxy, worker = self._proxied()
        fault = self._pool_fault("ack_silent", worker)
        self._freeze(proxy, self._request("ack"), False, worker)
        return self._await_answer(proxy, fault)

    def _fault_publish_silent(self) -> Fault:
        """The producer's next enqueue runs in Redis; its reply never comes and its
        connection stays open, passing nothing."""
        proxy = self.producer_proxy
        assert proxy is not None
        now = time.time()
        self._freeze(proxy, ENQUEUE_REQUEST[self.mode], True, None)
        return self._await_answer(proxy, Fault("publish_silent", now, None, 0))

    def _freeze(self, proxy: Proxy, trigger: bytes, forward: bool,
                worker: WorkerProcess | None) -> None:
        """Arm ``proxy.freeze_on`` and wait until it strikes (on a request of the
        proxied ``worker``, which may need jobs to send one); disarm if it does not."""
        proxy.freeze_on(trigger, forward)
        struck, within = (lambda: int(proxy.frozen_at is not None)), self._interval * 0.3
        try:
            if worker is None:
                self._await_strike(struck, 0, "request frozen", within=within)
            else:
                self._await_own_strike(worker, struck, 0, "request frozen", within=within)
        except RuntimeError:
            proxy.disarm()
            raise

    def _await_answer(self, proxy: Proxy, fault: Fault) -> Fault:
        """Wait, within most of the fault's interval, until the frozen request's kind is
        answered on another connection; ``fault.resumed`` is how long that took."""
        struck = proxy.frozen_at
        assert struck is not None
        deadline = struck + self._interval * 0.6
        while proxy.answered_at is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proxy.answered_at is not None:
            fault.resumed = round(proxy.answered_at - struck, 2)
        return fault

    def _note_reconciles(self) -> None:
        """Ours: what the pools' logs say they put right after a lost reply or ack."""
        if self.mode != "ours":
            return
        returned = acks = 0
        for w in self.pools + self._retired:
            if w.started:
                text = w.log_text()
                returned += sum(int(n) for n in re.findall(r"returned (\d+) job\(s\) of pool",
                                                           text))
                acks += sum(int(n) for n in re.findall(r"(\d+) ack\(s\) could not reach",
                                                       text))
        if returned or acks:
            self.result.notes.append(f"pools returned {returned} job(s) to their queues after "
                                     f"a lost reply or connection; {acks} ack(s) applied at "
                                     "reconnect")


def _job_id(raw: bytes) -> str:
    """The task id of an in-flight record's value ("<queue>\n<payload>"), or ""."""
    payload = raw.decode("utf-8", "replace").split("\n", 1)[-1]
    try:
        return str(json.loads(payload)["headers"]["id"])
    except (ValueError, KeyError, TypeError):
        return ""


def _link_up(replica: RedisServer) -> bool:
    """The replica's link to its master is up (it has synced)."""
    try:
        with replica.client(socket_timeout=1.0) as c:
            return bool(c.info("replication").get("master_link_status") == "up")
    except redis.RedisError:
        return False
