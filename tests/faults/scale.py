"""The scale soak: a million near-no-op jobs and hundreds of pool kills, stock beside ours.

``python -m tests.faults --scale-soak`` runs ``scale_soak_prefork`` and
``scale_soak_threads`` for each transport. A :class:`ScaleRun` is a ``harness.Run`` whose
parts that grow with the job count are rebuilt for millions of records:

- the **record** is read as it grows (:class:`RecordTail`: only the new bytes, folded
  into counters), never re-read in full;
- the **producers** are separate processes, each a plain ``apply_async`` loop over its
  share of the job ids (the same path as every other run: no pipelining on either
  side); they keep at most ``Options.max_queued`` jobs sent and not yet done, so the
  server holds a bounded backlog and every kill hits pools with full prefetch windows;
- the **kills** are spread over the jobs: kill ``k`` of ``n`` waits until ``k+1`` of
  ``n+1`` parts of the jobs are done, and at least ``--interval`` seconds after the
  previous one (a replacement pool starts as in every run: the kill waits for it);
- no pool goes through the proxy (the Python proxy would cap the drain).
"""

from __future__ import annotations

import multiprocessing
import random
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tests.faults.harness import Fault, Result, Run

#: The scenarios ``--scale-soak`` runs, per transport.
SCALE_SCENARIOS = ("scale_soak_prefork", "scale_soak_threads")

#: The sizes ``--scale-soak`` uses unless given: per scenario and transport, so 4 runs
#: make 1,000,000 jobs and 300 kills.
SCALE_DEFAULTS: dict[str, Any] = {"jobs": 250_000, "faults": 75, "interval": 1.0,
                                  "job_ms": 0.0, "settle": 30.0, "max_settle": 600.0}

#: Seconds between two looks at the record while producing or settling.
POLL = 0.05
#: Seconds between two progress lines.
PROGRESS_EVERY = 30.0


def job_id(i: int) -> str:
    return f"job-{i:07d}"


class RecordTail:
    """The append-only record, read as it grows: counters, not lines.

    A line is folded in once it is complete (ends with a newline); a line still being
    written waits for the next ``poll``. ``open`` holds (job, pid) pairs started and not
    done: a killed pool's jobs stay there.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._rest = b""
        self._lock = threading.Lock()
        self.lines = 0
        self.starts: Counter[str] = Counter()
        #: Starts from a fresh (not redelivered) message, per job.
        self.first_starts: Counter[str] = Counter()
        #: Job -> the times it was done (usually one).
        self.done: dict[str, list[float]] = {}
        self.open: Counter[tuple[str, int]] = Counter()

    def poll(self) -> None:
        with self._lock:
            try:
                with self.path.open("rb") as f:
                    f.seek(self._offset)
                    chunk = f.read()
            except FileNotFoundError:
                return
            self._offset += len(chunk)
            data = self._rest + chunk
            cut = data.rfind(b"\n") + 1
            self._rest = data[cut:]
            for raw in data[:cut].decode().splitlines():
                self._fold(raw.split())

    def _fold(self, parts: list[str]) -> None:
        if len(parts) not in (4, 5):
            return
        self.lines += 1
        kind, job, pid, at = parts[0], parts[1], int(parts[2]), float(parts[3])
        if kind == "S":
            self.starts[job] += 1
            self.open[(job, pid)] += 1
            if parts[4:] == ["first"]:
                self.first_starts[job] += 1
        elif kind == "D":
            self.done.setdefault(job, []).append(at)
            key = (job, pid)
            self.open[key] -= 1
            if self.open[key] <= 0:
                del self.open[key]

    def running(self, pids: set[int]) -> list[str]:
        """Jobs started by ``pids`` and not done (as of the last ``poll``)."""
        with self._lock:
            return sorted({job for (job, pid) in self.open if pid in pids})


def _producer(mode: str, url: str, install: bool, acks_late: bool, names: int,
              seconds: float, first: int, step: int, jobs: int, allowed: Any, sent: Any,
              out: Any) -> None:
    """One producer process: ``apply_async`` for jobs ``first``, ``first+step``, ...,
    each once ``allowed`` passes its index; puts the refused ``(index, error)`` on ``out``."""
    from tests.faults.app import job_names, make_app

    app = make_app(mode, url, install=install, acks_late=acks_late, names=names)
    tasks = [app.tasks[name] for name in job_names(names)]
    refused: list[tuple[int, str]] = []
    for i in range(first, jobs, step):
        while i >= allowed.value:
            time.sleep(0.002)
        try:
            tasks[i % len(tasks)].apply_async((job_id(i), seconds), task_id=job_id(i))
        except Exception as exc:  # the caller learns: this job was never accepted
            refused.append((i, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]))
        with sent.get_lock():
            sent.value += 1
    app.close()
    out.put(refused)


class ScaleRun(Run):
    """``Run`` for the scale soak (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tail = RecordTail(self.record_path)
        self._ctx = multiprocessing.get_context("spawn")
        self._sent = self._ctx.Value("q", 0)
        self._kills_done = 0
        #: While settling: the accepted ids (:meth:`_done_count`), the next progress line.
        self._settling: set[str] | None = None
        self._next_line: float | None = None

    def _url(self, via_proxy: bool, proxy: Any = None) -> str:
        return super()._url(False, proxy)

    def _env(self) -> dict[str, str]:
        return {**super()._env(), "FAULTS_QUIET": "1"}

    def _job_seconds(self) -> float:
        if self.opt.job_ms >= 0:
            return self.opt.job_ms / 1000
        return round(random.Random(self.opt.seed).uniform(*self.opt.short_seconds), 4)

    # -- producing ----------------------------------------------------------------------
    def _produce(self) -> None:
        allowed = self._ctx.Value("q", self.opt.max_queued, lock=False)
        out = self._ctx.Queue()
        n = max(1, self.opt.producers)
        procs = [self._ctx.Process(
            target=_producer, name=f"producer-{k}", daemon=True,
            args=(self.mode, self._url(False), not self.scenario.dropin,
                  self.scenario.acks_late, len(self.names), self._job_seconds(), k, n,
                  self.opt.jobs, allowed, self._sent, out)) for k in range(n)]
        for p in procs:
            p.start()
        refused: list[tuple[int, str]] = []
        reported = 0
        next_line = time.monotonic() + PROGRESS_EVERY
        while reported < n:
            self.tail.poll()
            allowed.value = len(self.tail.done) + self.opt.max_queued
            try:
                refused += out.get(timeout=POLL)
                reported += 1
            except Exception:  # queue.Empty: not finished yet
                pass
            if not any(p.is_alive() for p in procs) and out.empty() and reported < n:
                self.result.notes.append(f"{n - reported} producer(s) died without a report")
                break
            if time.monotonic() > next_line:
                next_line += PROGRESS_EVERY
                self._progress()
        for p in procs:
            p.join(timeout=10)
        gone = {i for i, _ in refused}
        self._errors = [error for _, error in refused]
        self._accepted = [job_id(i) for i in range(self.opt.jobs) if i not in gone]
        self._producer_done.set()

    def _progress(self) -> None:
        self.log(f"  {self.scenario.name}/{self.mode}: sent {self._sent.value:,}, done "
                 f"{len(self.tail.done):,}, kills {self._kills_done}, "
                 f"{self.tail.lines:,} record lines")

    # -- faults -------------------------------------------------------------------------
    def _inject_faults(self) -> None:
        """Kill ``k`` of ``n`` once ``(k+1)/(n+1)`` of the jobs are done (or nothing
        finished for ``settle`` s), ``interval`` s after the last at least; then wait
        for the producers."""
        plan = self._fault_plan()
        last = time.monotonic() - self._interval
        for k, kind in enumerate(plan):
            target = (k + 1) * self.opt.jobs // (len(plan) + 1)
            seen, since = -1, time.monotonic()
            while True:
                self.tail.poll()
                done = len(self.tail.done)
                if done >= target:
                    break
                if done != seen:
                    seen, since = done, time.monotonic()
                elif time.monotonic() - since > self.opt.settle:
                    self.result.notes.append(f"kill {k + 1}: nothing finished for "
                                             f"{self.opt.settle:.0f} s; killed anyway")
                    break
                time.sleep(POLL)
            time.sleep(max(0.0, last + self._interval - time.monotonic()))
            last = time.monotonic()
            try:
                fault = getattr(self, f"_fault_{kind}")()
            except Exception as exc:
                self.result.notes.append(f"{kind}: fault injection failed: {exc!r}")
                continue
            self.result.faults.append(fault)
            self._kills_done += 1
        self._producer_done.wait()

    def _pool_in_flight(self, worker: Any, pids: set[int] | None = None
                        ) -> tuple[int, list[str]]:
        if self.mode == "ours":
            return super()._pool_in_flight(worker, pids)
        self.tail.poll()
        running = self.tail.running(pids or self._pids(worker))
        return len(running), []

    def _pool_fault(self, kind: str, worker: Any, pids: set[int] | None = None) -> Fault:
        pids = pids or self._pids(worker)
        in_flight, owned = self._pool_in_flight(worker, pids)
        now = time.time()
        self.tail.poll()
        return Fault(kind, now, worker.hostname.split("@")[0], in_flight,
                     self.tail.running(pids), owned)

    # -- settling and counting ----------------------------------------------------------
    def _done_count(self) -> int:
        """Accepted jobs done, from the record's tail (read as it grows, never whole)."""
        self.tail.poll()
        if self._settling is None:  # the accepted ids are final once the producers ended
            self._settling = set(self._accepted)
        return len(self._settling.intersection(self.tail.done))

    def _settle_pause(self) -> None:
        """A progress line every ``PROGRESS_EVERY`` s while the last jobs finish."""
        now = time.monotonic()
        if self._next_line is None:
            self._next_line = now + PROGRESS_EVERY
        elif now > self._next_line:
            self._next_line += PROGRESS_EVERY
            self._progress()
        time.sleep(0.5)

    def _count(self) -> None:
        self.tail.poll()
        t, r = self.tail, self.result
        accepted = set(self._accepted)
        done = accepted.intersection(t.done)
        r.accepted, r.refused = len(accepted), len(self._errors)
        r.refused_error = self._errors[0] if self._errors else ""
        r.done = len(done)
        dead = self._dead_jobs() if self.mode == "ours" else {}
        dead = {job: why for job, why in dead.items() if job in accepted and job not in done}
        r.dead, r.dead_reasons = len(dead), dict(Counter(dead.values()))
        lost = sorted(accepted - done - set(dead))
        r.lost, r.lost_sample = len(lost), lost[:5]
        r.starts = sum(t.starts.values())
        r.duplicates = r.starts - len(t.starts)
        stored_twice = {job for job, n in t.first_starts.items() if n > 1}
        r.publish_retry_duplicates = sum(t.first_starts[job] - 1 for job in stored_twice)
        if self.mode == "ours":
            twice = {job for job, n in t.starts.items() if n > 1}
            owned = {job for f in r.faults for job in f.owned}
            r.unexplained_duplicates = len(twice - owned - stored_twice)
            r.pools_reaped = self._reaped()
        r.in_flight_at_faults = sum(f.in_flight for f in r.faults)
        for f in r.faults:
            running = set(f.running) - set(dead)
            ends = [min((at for at in t.done.get(job, []) if at >= f.at), default=-1.0)
                    for job in running]
            if -1.0 not in ends:
                f.recovery = round(max(ends, default=f.at) - f.at, 2)
        recoveries = sorted(f.recovery for f in r.faults if f.recovery is not None)
        r.unrecovered_faults = len(r.faults) - len(recoveries)
        if recoveries:
            r.recovery_median = recoveries[len(recoveries) // 2]
            r.recovery_max = recoveries[-1]
        r.crashed_pools = sum(1 for w in self.pools if w.started and not w.alive)

    def _reaped(self) -> int:
        return sum(int(m.group(1)) for w in self.pools + self._retired if w.started
                   for m in re.finditer(r"reaped (\d+) dead worker pool", w.log_text()))


def _per_kill(n: int, kills: int) -> str:
    return f"{n / kills:.3f}" if kills else "-"


def scale_table(results: list[Result]) -> str:
    """Markdown table of scale-soak runs: one row per transport and pool, then totals."""
    head = ("| side | pool | jobs | kills | lost | lost per kill | run twice | run twice "
            "per kill | in flight per kill | refused | dead set | minutes |")
    rows = [head, "|---|---|" + "---:|" * 10]
    totals: dict[str, Counter[str]] = {}
    for r in results:
        kills = len(r.faults)
        pool = r.scenario.removeprefix("scale_soak_")
        rows.append(f"| {r.mode} | {pool} | {r.accepted:,} | {kills} | {r.lost:,} | "
                    f"{_per_kill(r.lost, kills)} | {r.duplicates:,} | "
                    f"{_per_kill(r.duplicates, kills)} | "
                    f"{_per_kill(r.in_flight_at_faults, kills)} | {r.refused:,} | "
                    f"{r.dead:,} | {r.seconds / 60:.1f} |")
        total = totals.setdefault(r.mode, Counter())
        total.update(jobs=r.accepted, kills=kills, lost=r.lost, dup=r.duplicates,
                     inflight=r.in_flight_at_faults, refused=r.refused, dead=r.dead,
                     seconds=int(r.seconds))
    for mode, c in totals.items():
        rows.append(f"| **{mode}** | all | {c['jobs']:,} | {c['kills']} | {c['lost']:,} | "
                    f"{_per_kill(c['lost'], c['kills'])} | {c['dup']:,} | "
                    f"{_per_kill(c['dup'], c['kills'])} | "
                    f"{_per_kill(c['inflight'], c['kills'])} | {c['refused']:,} | "
                    f"{c['dead']:,} | {c['seconds'] / 60:.1f} |")
    return "\n".join(rows)
