"""Pure parts of the benchmark's accounts: ``strace -c`` summaries (``bench.syscalls``)
and the issue's drain targets checked on both rates (``bench.report.targets``)."""

from __future__ import annotations

from bench.report import Row, targets
from bench.syscalls import parse_strace_summary

# A prefork main process of ours under ``strace -c -f`` (a real summary, trimmed).
SUMMARY = """\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 47.80    0.292864      146432         2         1 restart_syscall
 39.23    0.240361         224      1069           poll
  6.30    0.038625           5      7251      5865 epoll_ctl
  2.48    0.015208           5      2760           read
  0.16    0.000956          22        42         8 futex
------ ----------- ----------- --------- --------- ----------------
100.00    0.612679          40     14955      5874 total
"""


def test_strace_summary_counts_calls_with_and_without_errors() -> None:
    assert parse_strace_summary(SUMMARY) == {
        "restart_syscall": 2, "poll": 1069, "epoll_ctl": 7251, "read": 2760, "futex": 42}


def test_strace_summary_of_nothing_is_empty() -> None:
    assert parse_strace_summary("") == {}
    assert parse_strace_summary(SUMMARY.split("\n", 2)[0]) == {}


def _drain(config: str, metric: str, stock: float | None, ours: float | None,
           dramatiq: float | None) -> Row:
    row = Row("drain", config, metric, True)
    for side, value in (("stock", stock), ("ours", ours), ("dramatiq", dramatiq)):
        if value is not None:
            row.add(side, value)
    return row


def test_drain_targets_are_checked_on_the_rate_from_start_and_named_on_the_steady_one() -> None:
    rows = [
        _drain("prefork -c 2, acks late", "jobs/s", 1000, 2000, None),
        _drain("prefork -c 2, acks late", "steady jobs/s", 1100, 2200, None),
        _drain("2 workers x threads -c 8, acks late", "jobs/s", 1500, 3900, None),
        _drain("2 workers x threads -c 8, acks late", "steady jobs/s", 1600, 4400, None),
        _drain("dramatiq --processes 2 --threads 8", "jobs/s", None, None, 4000),
        _drain("dramatiq --processes 2 --threads 8", "steady jobs/s", None, None, 4200),
    ]
    got = {c["target"]: (c["value"], c["met"]) for c in targets(rows)}
    assert got == {
        "drain prefork -c 2, acks late: ours/stock >= 1.0": (2.0, True),
        "drain prefork -c 2, acks late: ours/Dramatiq >= 0.7": (0.5, False),
        "drain prefork -c 2, acks late, startup left out: ours/Dramatiq >= 0.7": (0.524, False),
        "drain 2 workers x threads -c 8, acks late: ours/stock >= 1.0": (2.6, True),
        "drain 2 workers x threads -c 8, acks late: ours/Dramatiq >= 1": (0.975, False),
        "drain 2 workers x threads -c 8, acks late, startup left out: ours/Dramatiq >= 1":
            (1.048, True),
    }
