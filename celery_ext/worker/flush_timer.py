"""When an executing process writes its job counters, runtimes and history (issue 36).

A flush is one script call whatever it carries, and it costs Redis about what a job
costs: written every second by every busy process, 200 solo pools sharing 300 jobs a
second paid 1.4 flush calls per job. So a flush waits for jobs: a second after the last
once ``STATS_FLUSH_JOBS`` jobs ended (or one failed: alerts watch failures), else up to
``STATS_FLUSH_MAX_INTERVAL``, and never past the end of the Redis-clock minute of its
first count, so the per-minute history keeps each count in its minute. A process's first
counts go at once; its stop writes what is left (``Observer.stop``, ``flush_observers``).
"""

from __future__ import annotations

import time

#: Counters, runtimes and history are written at most this often (seconds), and this
#: often while jobs end fast enough (``STATS_FLUSH_JOBS``) or one failed.
STATS_FLUSH_INTERVAL = 1.0
#: Jobs ended since the last write that make the next one due ``STATS_FLUSH_INTERVAL``
#: after it: a flush then carries at least this many jobs.
STATS_FLUSH_JOBS = 20
#: The longest a count waits in memory (seconds), however few jobs ended: the counters'
#: lag for a process that runs a job now and then.
STATS_FLUSH_MAX_INTERVAL = 5.0


class FlushTimer:
    """The due time of one observer's counter flush (the observer calls every method
    under its lock, the one every job's start and end take)."""

    __slots__ = ("failed", "jobs", "last", "minute_ends")

    def __init__(self) -> None:
        #: When the counts were last taken to be written (monotonic): the first are due
        #: at once.
        self.last = time.monotonic() - STATS_FLUSH_MAX_INTERVAL
        #: Jobs ended since then, and whether one failed.
        self.jobs = 0
        self.failed = False
        #: When (monotonic) the Redis-clock minute of the first count since then ends
        #: (None: no count waits).
        self.minute_ends: float | None = None

    def counted(self, clock_offset: float, jobs: int = 0, failed: bool = False) -> None:
        """A count was summed (``jobs`` ended, one ``failed``; none: a job's wait at its
        start); ``clock_offset``: Redis time minus this host's."""
        self.jobs += jobs
        self.failed = self.failed or failed
        if self.minute_ends is None:
            self.minute_ends = time.monotonic() + 60 - (time.time() + clock_offset) % 60

    def due(self) -> float:
        """When (monotonic) the counts summed since the last write are due."""
        soon = self.last + STATS_FLUSH_INTERVAL
        if self.jobs >= STATS_FLUSH_JOBS or self.failed:
            return soon
        later = self.last + STATS_FLUSH_MAX_INTERVAL
        if self.minute_ends is not None:
            later = min(later, self.minute_ends)
        return max(soon, later)

    def taken(self, now: float) -> tuple[int, bool, float | None]:
        """The counts are taken to be written at ``now``; returns what made them due, for
        ``restore`` when the write fails."""
        pending = (self.jobs, self.failed, self.minute_ends)
        self.jobs, self.failed, self.minute_ends, self.last = 0, False, None, now
        return pending

    def restore(self, pending: tuple[int, bool, float | None]) -> None:
        """Counts a flush could not write are pending again."""
        jobs, failed, minute_ends = pending
        self.jobs += jobs
        self.failed = self.failed or failed
        if minute_ends is not None:
            self.minute_ends = min(self.minute_ends or minute_ends, minute_ends)
