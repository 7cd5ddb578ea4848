"""History kept in Redis: job counts, runtime percentiles and queue sizes over time.

The dashboard's plots read it, so they survive a dashboard restart and exist when no
dashboard runs. Two resolutions, each a hash per time bucket that expires on its own:

* ``{ns}:history:m:<minute>`` per minute, kept ``MINUTE_RETENTION`` (24 h) past its minute;
* ``{ns}:history:h:<hour>`` per hour, kept ``HOUR_RETENTION`` (30 days) past its hour.

Fields of each hash:

* ``*``: all jobs, ``"<processed> <failed> <retried> <bucket>:<n> ..."``: the three
  counts, then the runtime histogram (only buckets that are not empty);
* ``n:<job name>``: the same for one job name;
* ``q``: the last queue-size sample of the bucket,
  ``"<queued> <in flight> <scheduled> <retry> <dead> <latency ms or -1>"``.

Who writes it: the executing process of every job (the observer, through
:class:`HistoryWriter`) sums counts and runtimes in memory and adds them with its job
counters in one ``history`` script call per flush (``worker/flush_timer.py`` says when:
at most once a second, at least every few seconds while counts wait); the leading requeuer of
the worker pools (:mod:`celery_ext.worker.requeuer`) samples queue sizes every
``history_sample_interval``. Every bucket is on the Redis clock (the script picks
the minute from ``TIME``). Runtime histograms use ``BUCKETS`` fixed log-spaced
buckets (bucket ``i >= 1`` holds runtimes in ``[2**(i-1), 2**i)`` ms); percentiles
are computed on read (interpolated inside a bucket: off by less than its factor of 2).

Memory is bounded by the number of buckets alive (1,440 minute hashes and 720 hour
hashes at most, the newest at most a minute and an hour past the retention) times
the job names active in each; ``docs/history.md`` has the figures.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, TypedDict

from kombu.utils.encoding import bytes_to_str

from celery_ext.config import Settings
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts

logger = logging.getLogger("celery_ext.store.history")

#: Seconds a per-minute bucket is kept after its minute (the 24-hour plots).
MINUTE_RETENTION = 24 * 3600
#: Seconds a per-hour bucket is kept after its hour (the 30-day plots).
HOUR_RETENTION = 30 * 24 * 3600
#: Runtime histogram buckets: 0 is under 1 ms, i >= 1 is [2**(i-1), 2**i) ms, the last
#: one everything from 2**22 ms (70 minutes) up.
BUCKETS = 24
#: Field of the counts of all jobs, and prefix of one job name's field.
ALL = "*"
NAME_PREFIX = "n:"
#: Field of the queue-size sample.
GAUGE = "q"
#: Plot windows: name -> (seconds, resolution in seconds).
WINDOWS = {"1h": (3600, 60), "6h": (6 * 3600, 60), "24h": (24 * 3600, 60),
           "7d": (7 * 24 * 3600, 3600), "30d": (30 * 24 * 3600, 3600)}
#: Percentiles reported for runtimes.
QUANTILES = (0.5, 0.95, 0.99)
#: Pipelined reads per round trip when reading a window.
READ_CHUNK = 500

OUTCOME_INDEX = {"processed": 0, "failed": 1, "retried": 2}
GAUGE_FIELDS = ("queued", "in_flight", "scheduled", "retry", "dead")


def bucket_of(seconds: float) -> int:
    """The histogram bucket of a runtime."""
    ms = seconds * 1000
    if ms < 1:
        return 0
    return min(BUCKETS - 1, int(math.log2(ms)) + 1)


def bucket_bounds(i: int) -> tuple[float, float]:
    """Lower and upper bound (seconds) of bucket ``i`` (the last one's upper is inf)."""
    if i == 0:
        return 0.0, 0.001
    return 2 ** (i - 1) / 1000, (2 ** i / 1000 if i < BUCKETS - 1 else math.inf)


def percentile(buckets: dict[int, int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a histogram, interpolated geometrically inside
    its bucket (linearly in bucket 0; the lower bound in the last, open one)."""
    total = sum(buckets.values())
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for i in sorted(buckets):
        n = buckets[i]
        if n <= 0:
            continue
        if seen + n >= rank:
            lo, hi = bucket_bounds(i)
            frac = (rank - seen) / n
            if i == 0:
                return hi * frac
            if math.isinf(hi):
                return lo
            return float(lo * (hi / lo) ** frac)
        seen += n
    return bucket_bounds(max(buckets))[0]


def pack(counts: Sequence[int], buckets: dict[int, int]) -> str:
    return " ".join([*(str(int(c)) for c in counts),
                     *(f"{i}:{n}" for i, n in sorted(buckets.items()) if n)])


def unpack(packed: bytes | str | None) -> tuple[list[int], dict[int, int]]:
    """``pack``'s inverse; junk words (the field is readable by anyone) count as 0."""
    counts, buckets = [0, 0, 0], dict[int, int]()
    if not packed:
        return counts, buckets
    for k, word in enumerate(bytes_to_str(packed).split()):
        try:
            if k < 3:
                counts[k] = int(word)
            else:
                i, n = word.split(":")
                if 0 <= int(i) < BUCKETS:
                    buckets[int(i)] = buckets.get(int(i), 0) + int(n)
        except ValueError:
            continue
    return counts, buckets


class _Sum:
    __slots__ = ("buckets", "counts")

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.buckets: dict[int, int] = {}

    def add(self, index: int, bucket: int | None) -> None:
        self.counts[index] += 1
        if bucket is not None:
            self.buckets[bucket] = self.buckets.get(bucket, 0) + 1


def _counter_args(stats: dict[str, int], runtime: dict[str, int]) -> list[Any]:
    """The counters of a flush as ``history.lua``'s count mode takes them: the fields of
    no queue as pairs, then per job queue its name and its ``{ns}:stats`` and
    ``{ns}:runtime`` increments packed ``"<prefix> <amount> ..."`` (three arguments per
    queue instead of two per field: at 10,000 job names a flush carries seven fields per
    name that ran, and each argument cost this process its encoding and Redis its
    parsing; issue 36). A field ``"<prefix>:<queue>"`` whose prefix holds a space goes
    as a pair."""
    plain: tuple[list[Any], list[Any]] = ([], [])
    by_queue: dict[str, tuple[list[str], list[str]]] = {}
    for side, counts in enumerate((stats, runtime)):
        for field, amount in counts.items():
            prefix, sep, queue = field.partition(":")
            if not sep or " " in prefix:
                plain[side].extend((field, amount))
                continue
            packed = by_queue.get(queue)
            if packed is None:
                packed = by_queue[queue] = ([], [])
            packed[side].append(f"{prefix} {amount}")
    args: list[Any] = [len(plain[0]) // 2, len(plain[1]) // 2, len(by_queue),
                       *plain[0], *plain[1]]
    for queue, (stat_fields, runtime_fields) in by_queue.items():
        args += (queue, " ".join(stat_fields), " ".join(runtime_fields))
    return args


class HistoryWriter:
    """Adds to the history of one namespace; ``add()`` sums in memory, ``flush()``
    writes (one script call), ``gauge()`` writes a queue-size sample."""

    def __init__(self, client: Any, settings: Settings) -> None:
        self.client = client
        self.keys = Keys.for_settings(settings)
        self.scripts = Scripts(client)
        #: Redis clock minus this host's clock (seconds), learned from the script.
        self.offset = 0.0
        self._sums: dict[str, _Sum] = {}
        self._lock = threading.Lock()

    def add(self, name: str, outcome: str, runtime: float | None) -> None:
        """Count one job run of ``name`` (its runtime in seconds, if it ran here)."""
        index = OUTCOME_INDEX.get(outcome)
        if index is None:
            return
        bucket = bucket_of(runtime) if runtime is not None and runtime >= 0 else None
        with self._lock:
            for field in (ALL, NAME_PREFIX + name):
                total = self._sums.get(field)
                if total is None:
                    total = self._sums[field] = _Sum()
                total.add(index, bucket)

    def flush(self, stats: dict[str, int] | None = None,
              runtime: dict[str, int] | None = None) -> None:
        """Write what ``add()`` summed, with a process's job counters: ``stats`` and
        ``runtime`` are ``{ns}:stats`` and ``{ns}:runtime`` increments (the queues of the
        per-queue stats fields join ``{ns}:queues``, so a reader that forgot the queue forgets them
        again: ``queue_info.lua``). One script
        call and one ``TIME`` for all (nothing to write: no call), so a busy process's
        flush costs Redis one call, not three.

        Raises when that call fails: the caller counts its counters again, and the
        history's sums go back to be written by the next flush. Once the counters are
        written, a history that could not be (this host's clock off by a minute or more,
        then Redis out of reach) also waits for the next flush."""
        stats, runtime = stats or {}, runtime or {}
        with self._lock:
            sums, self._sums = self._sums, {}
        if not (sums or stats or runtime):
            return
        counters = _counter_args(stats, runtime)
        history = [x for field, s in sums.items() for x in (field, pack(s.counts, s.buckets))]
        try:
            written = self._call("count", [*counters, *history])
        except BaseException:
            self._put_back(sums)
            raise
        if not written and sums:  # the counters are written; the history goes again
            try:
                self._write("count", [0, 0, 0, *history])
            except Exception:
                self._put_back(sums)

    def _put_back(self, sums: dict[str, _Sum]) -> None:
        with self._lock:
            for field, s in sums.items():
                total = self._sums.setdefault(field, _Sum())
                total.counts = [a + b for a, b in zip(total.counts, s.counts, strict=True)]
                for i, n in s.buckets.items():
                    total.buckets[i] = total.buckets.get(i, 0) + n

    def gauge(self, sample: dict[str, Any]) -> None:
        """Store a queue-size sample for the current minute and hour."""
        latency = sample.get("latency")
        values = [int(sample.get(f) or 0) for f in GAUGE_FIELDS]
        values.append(int(latency * 1000) if latency is not None else -1)
        self._write("gauge", [" ".join(map(str, values))])

    def _write(self, mode: str, args: list[Any]) -> None:
        for _ in range(3):
            if self._call(mode, args):
                return
        logger.warning("celery_ext: history not written: this host's clock keeps moving "
                       "against the Redis clock")

    def _call(self, mode: str, args: list[Any]) -> bool:
        """One script call for the minute this host guesses; False when Redis says the
        guess is off (the offset is learned from its reply, for the next call)."""
        minute = int((time.time() + self.offset) // 60)
        hours = [m // 60 for m in (minute - 1, minute, minute + 1)]
        keys = [*(self.keys.history_minute(m) for m in (minute - 1, minute, minute + 1)),
                *(self.keys.history_hour(h) for h in hours)]
        if mode == "count":
            keys += [self.keys.stats, self.keys.runtime, self.keys.queues]
        written, now_ms = self.scripts(
            "history", keys, [minute, mode, MINUTE_RETENTION * 1000, HOUR_RETENTION * 1000, *args])
        if not written:
            self.offset = int(now_ms) / 1000 - time.time()
        return bool(written)


def sample_queues(state: Any, counts: dict[str, int]) -> dict[str, Any]:
    """A queue-size sample from ``State.job_queues()`` and the set sizes."""
    queues = state.job_queues()
    latencies = [q["latency"] for q in queues if q["latency"] is not None]
    return {"queued": sum(q["size"] for q in queues),
            "in_flight": sum(q["in_flight"] for q in queues),
            "scheduled": counts.get("scheduled", 0), "retry": counts.get("retry", 0),
            "dead": counts.get("dead", 0), "latency": max(latencies) if latencies else None}


class Series(TypedDict):
    window: str
    resolution: int  # seconds per point
    t: list[float]  # start of each bucket, Redis-clock seconds
    processed: list[int]
    failed: list[int]
    retried: list[int]
    processed_rate: list[float]  # jobs/s over the bucket
    failed_rate: list[float]
    p50: list[float | None]  # runtime percentiles of the bucket, seconds
    p95: list[float | None]
    p99: list[float | None]
    queued: list[int | None]  # last sample of the bucket; None: no sample
    in_flight: list[int | None]
    scheduled: list[int | None]
    retry: list[int | None]
    dead: list[int | None]
    latency: list[float | None]  # age of the oldest queued job, seconds


class Runtime(TypedDict):
    name: str
    processed: int
    failed: int
    retried: int
    p50: float | None
    p95: float | None
    p99: float | None


def window_of(window: str) -> tuple[int, int]:
    """(seconds, resolution) of a window name; ValueError names the valid ones."""
    try:
        return WINDOWS[window]
    except KeyError:
        raise ValueError(f"window must be one of {', '.join(WINDOWS)}, "
                         f"got {window!r}") from None


class HistoryReader:
    """Reads the history of one namespace for plots and runtime tables."""

    def __init__(self, client: Any, settings: Settings) -> None:
        self.client = client
        self.keys = Keys.for_settings(settings)

    def _buckets(self, window: str, now: float) -> tuple[int, list[int], list[str]]:
        span, step = window_of(window)
        last = int(now // step)
        starts = list(range(last - span // step + 1, last + 1))
        build = self.keys.history_minute if step == 60 else self.keys.history_hour
        return step, starts, [build(b) for b in starts]

    def _read(self, keys: list[str], fields: Iterable[str] | None) -> list[Any]:
        """HMGET ``fields`` (or HGETALL) of each key, pipelined in chunks."""
        wanted = list(fields) if fields is not None else None
        out: list[Any] = []
        for i in range(0, len(keys), READ_CHUNK):
            with self.client.pipeline(transaction=False) as pipe:
                for key in keys[i:i + READ_CHUNK]:
                    if wanted is None:
                        pipe.hgetall(key)
                    else:
                        pipe.hmget(key, wanted)
                out += pipe.execute()
        return out

    def series(self, window: str, now: float) -> Series:
        """One point per bucket of ``window`` up to ``now`` (Redis seconds)."""
        step, starts, keys = self._buckets(window, now)
        out = Series(window=window, resolution=step, t=[], processed=[], failed=[],
                     retried=[], processed_rate=[], failed_rate=[], p50=[], p95=[], p99=[],
                     queued=[], in_flight=[], scheduled=[], retry=[], dead=[], latency=[])
        for start, (packed, gauge) in zip(starts, self._read(keys, (ALL, GAUGE)), strict=True):
            counts, buckets = unpack(packed)
            out["t"].append(float(start * step))
            for k, name in enumerate(("processed", "failed", "retried")):
                out[name].append(counts[k])  # type: ignore[literal-required]
            out["processed_rate"].append(counts[0] / step)
            out["failed_rate"].append(counts[1] / step)
            for q, name in zip(QUANTILES, ("p50", "p95", "p99"), strict=True):
                out[name].append(percentile(buckets, q))  # type: ignore[literal-required]
            values = _gauge(gauge)
            for k, name in enumerate(GAUGE_FIELDS):
                out[name].append(values[k] if values else None)  # type: ignore[literal-required]
            out["latency"].append(
                values[5] / 1000 if values and values[5] >= 0 else None)
        return out

    def runtimes(self, window: str, now: float) -> list[Runtime]:
        """Counts and runtime percentiles per job name over ``window``, busiest first."""
        _step, _starts, keys = self._buckets(window, now)
        sums: dict[str, _Sum] = {}
        for fields in self._read(keys, None):
            for field, packed in fields.items():
                field = bytes_to_str(field)
                if not field.startswith(NAME_PREFIX):
                    continue
                counts, buckets = unpack(packed)
                total = sums.setdefault(field[len(NAME_PREFIX):], _Sum())
                total.counts = [a + b for a, b in zip(total.counts, counts, strict=True)]
                for i, n in buckets.items():
                    total.buckets[i] = total.buckets.get(i, 0) + n
        rows = [Runtime(name=name, processed=s.counts[0], failed=s.counts[1],
                        retried=s.counts[2], p50=percentile(s.buckets, 0.5),
                        p95=percentile(s.buckets, 0.95), p99=percentile(s.buckets, 0.99))
                for name, s in sums.items()]
        return sorted(rows, key=lambda r: (-(r["processed"] + r["failed"]), r["name"]))


def _gauge(packed: bytes | str | None) -> list[int] | None:
    if not packed:
        return None
    try:
        values = [int(v) for v in bytes_to_str(packed).split()]
    except ValueError:
        return None
    return values if len(values) == len(GAUGE_FIELDS) + 1 else None
