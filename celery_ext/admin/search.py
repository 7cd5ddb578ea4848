"""Search in the dead, scheduled and retry sets, and bulk actions on what matches.

Filters: job name (exact), error (the exception type, or a part of the error text),
a time range (failed at for the dead set, due at for the others) and text that the
job's message body (its arguments) must contain. The ``search`` script filters on the
server, ``SCAN_CHUNK`` entries per call in set order, reading only each record's meta
line as JSON; the argument text is looked for in the stored payload as it is (a
base64 body is searched through three encoded forms of the text, each candidate
decoded and compared in full), so no record crosses the network unless it matches.

A page is cursor-based: ``"<score>:<skip>"`` is where the next page starts (the
score reached, and how many entries at that score were already seen). A page stops
at ``limit`` matches or after ``SCAN_BUDGET`` entries, whichever comes first, and
then gives the cursor to go on. Bulk actions walk the same way, acting on each
chunk of matches as it is found, so their memory does not grow with the set.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kombu.utils.encoding import bytes_to_str

from celery_ext.store.copies import copies
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts

#: Entries one ``search`` script call reads (bounds how long it holds Redis).
SCAN_CHUNK = 500
#: Most entries one page request scans before it returns with a cursor.
SCAN_BUDGET = 20_000
#: Longest argument text accepted (it is compared inside Redis).
MAX_TEXT = 200
#: The sets that can be searched: kind -> (zset, records hash, newest first).
KINDS = ("dead", "scheduled", "retry")
#: Latest time a filter takes, in seconds either side of 1970 (the end of year 9999):
#: a score in milliseconds stays an exact integer far below it.
MAX_TIME = 253_402_300_800.0
#: A cursor as the search hands it out: a score Redis reads ("+inf"/"-inf" or a
#: decimal or exponent number, as Python and Redis both write them) and a skip count.
_CURSOR = re.compile(r"([-+]?(?:inf|(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)):(\d{1,15})", re.I)


@dataclass(frozen=True)
class Filters:
    """What a job must match; empty fields match everything."""

    name: str = ""
    error: str = ""
    text: str = ""
    since: float | None = None  # seconds (Redis clock), inclusive
    until: float | None = None

    def __post_init__(self) -> None:
        if len(self.text) > MAX_TEXT:
            raise ValueError(f"search text is longer than {MAX_TEXT} characters")
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and abs(value) <= MAX_TIME):
                raise ValueError(f"{name!r} must be a time in seconds between "
                                 f"{-MAX_TIME:.0f} and {MAX_TIME:.0f} (got {value!r})")
        if self.since is not None and self.until is not None and self.since > self.until:
            raise ValueError("'since' is after 'until'")

    @property
    def active(self) -> bool:
        return bool(self.name or self.error or self.text or self.since is not None
                    or self.until is not None)


def base64_patterns(text: str) -> list[Any]:
    """``text`` as it appears in a base64 body at each of the three byte alignments:
    (pattern, offset of the pattern in its 4-character group) three times. The
    characters touched by neighbouring bytes are left out, so the pattern is found
    whatever surrounds the text; a short text may have an empty pattern at an
    alignment (that alignment is then not searched)."""
    data = text.encode("utf-8")
    out: list[Any] = []
    for lead_bytes in range(3):
        encoded = base64.b64encode(b"\0" * lead_bytes + data).decode("ascii")
        first = -(-lead_bytes * 8 // 6)  # first character made only of the text's bits
        last = (lead_bytes + len(data)) * 8 // 6  # one past the last such character
        out += [encoded[first:last], first]
    return out


def parse_cursor(cursor: str | None) -> tuple[str, int] | None:
    """``"<score>:<skip>"`` -> (score, skip); ValueError naming the cursor for anything
    else, NaN included (Redis refuses it as a score: the page would fail as if Redis
    were down)."""
    if not cursor:
        return None
    found = _CURSOR.fullmatch(cursor)
    if found is None:
        raise ValueError(f"bad cursor {cursor!r}")
    return found.group(1), int(found.group(2))


class SetSearch:
    """Filtered scans of one of the three sets."""

    def __init__(self, client: Any, scripts: Scripts, keys: Keys, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}")
        self.client = client
        self.scripts = scripts
        self.kind = kind
        self.zset = {"dead": keys.dead, "scheduled": keys.scheduled, "retry": keys.retry}[kind]
        self.records = keys.dead_jobs if kind == "dead" else keys.scheduled_jobs
        self.newest_first = kind == "dead"

    def _range(self, f: Filters) -> tuple[str, str]:
        low = "-inf" if f.since is None else repr(int(f.since * 1000))
        high = "+inf" if f.until is None else repr(int(f.until * 1000))
        return (high, low) if self.newest_first else (low, high)

    def step(self, f: Filters, cursor: tuple[str, int] | None, limit: int,
             chunk: int = SCAN_CHUNK) -> tuple[list[tuple[str, float]], tuple[str, int] | None,
                                                int]:
        """One script call: (matches as (id, score ms), next cursor or None when the
        range is exhausted, entries scanned)."""
        matches, nxt, scanned, _ = self._step(f, cursor, limit, chunk)
        return matches, nxt, scanned

    def _step(self, f: Filters, cursor: tuple[str, int] | None, limit: int,
              chunk: int = SCAN_CHUNK, after: str = ""
              ) -> tuple[list[tuple[str, float]], tuple[str, int] | None, int, str]:
        """:meth:`step`, with the id of the last entry the previous step read (``after``:
        the entries at the cursor's score up to it are passed over whatever the skip
        says) and this step's last entry read."""
        start, stop = self._range(f)
        if cursor is not None:
            start = cursor[0]
        args: list[Any] = ["1" if self.newest_first else "0", start,
                           cursor[1] if cursor else 0, stop, chunk, max(1, limit),
                           f.name, f.error, f.text, after if cursor else ""]
        if f.text:
            args += base64_patterns(f.text)
        found, score, skip, scanned, done, last = self.scripts(
            "search", [self.zset, self.records], args)
        flat = [bytes_to_str(v) for v in found]
        matches = [(flat[i], float(flat[i + 1])) for i in range(0, len(flat), 2)]
        nxt = None if int(done) else (bytes_to_str(score), int(skip))
        return matches, nxt, int(scanned), bytes_to_str(last)

    def page(self, f: Filters, cursor: tuple[str, int] | None, limit: int
             ) -> tuple[list[tuple[str, float]], tuple[str, int] | None, int]:
        """Up to ``limit`` matches from ``cursor``, scanning at most ``SCAN_BUDGET``."""
        matches: list[tuple[str, float]] = []
        scanned = 0
        while True:
            got, cursor, n = self.step(f, cursor, limit - len(matches))
            matches += got
            scanned += n
            if cursor is None or len(matches) >= limit or scanned >= SCAN_BUDGET:
                return matches, cursor, scanned

    def count(self, f: Filters) -> int:
        """How many entries match (a full scan, in chunks)."""
        total, cursor = 0, None
        while True:
            got, cursor, _ = self.step(f, cursor, SCAN_CHUNK)
            total += len(got)
            if cursor is None:
                return total

    def act(self, f: Filters, action: Callable[[list[str]], set[str]]) -> int:
        """Apply ``action`` (ids -> the ids it removed from their place in the set) to
        every match, chunk by chunk; returns how many it removed.

        Each step goes on after the last entry the previous one read, by its id: what
        the action (or anyone else) removed or added meanwhile at the cursor's score
        neither skips an entry nor reads one twice. The skip is only where the next
        read starts; less what the action removed there, it stays right unless others
        changed that score too (then the script reads the score from its start)."""
        done_total, cursor, after = 0, None, ""
        while True:
            matches, nxt, _, after = self._step(f, cursor, SCAN_CHUNK, after=after)
            if matches:
                done = action([i for i, _ in matches])
                done_total += len(done)
                if nxt is not None:
                    removed = sum(1 for i, s in matches if i in done and _same(s, nxt[0]))
                    nxt = (nxt[0], max(0, nxt[1] - removed))
            if nxt is None:
                return done_total
            cursor = nxt


#: A match of a search over the copies: (score ms, job id, the copy holding it).
Match = tuple[float, str, Keys]


def search_sets(client: Any, scripts: Scripts, keys: Keys, kind: str, filters: Filters,
                start: tuple[str, int] | None, limit: int
                ) -> tuple[list[Match], str | None, int]:
    """Up to ``limit`` matches of the ``kind`` set from the cursor ``start`` (None: the
    start), in set order; the cursor that goes on (None: no more); entries scanned."""
    parts = copies(client, keys)
    if len(parts) > 1:
        return _search_copies(client, scripts, parts, kind, filters, start, max(1, limit))
    search = SetSearch(client, scripts, keys, kind)
    matches, nxt, scanned = search.page(filters, start, max(1, limit))
    return ([(score, job_id, keys) for job_id, score in matches],
            f"{nxt[0]}:{nxt[1]}" if nxt else None, scanned)


def _search_copies(client: Any, scripts: Scripts, parts: list[Keys], kind: str,
                   filters: Filters, start: tuple[str, int] | None, limit: int
                   ) -> tuple[list[Match], str | None, int]:
    """:func:`search_sets` over several copies (a cluster): each copy's matches from the
    cursor's score, merged in set order (score, then id). The cursor's skip counts
    the matches at its score already returned. A copy that stopped on the scan
    budget bounds the page: only matches before its stopping score are sure."""
    newest = kind == "dead"
    skip = start[1] if start else 0
    want = limit + skip
    found: list[Match] = []
    bound: float | None = None
    more = False
    scanned = 0
    for k in parts:
        search = SetSearch(client, scripts, k, kind)
        matches, nxt, n = search.page(filters, (start[0], 0) if start else None, want)
        scanned += n
        found += [(score, i, k) for i, score in matches]
        if nxt is not None and len(matches) < want:  # stopped by the scan budget
            b = float(nxt[0])
            bound = b if bound is None else (max(bound, b) if newest else min(bound, b))
        elif nxt is not None:
            more = True
    found.sort(key=lambda e: (e[0], e[1]), reverse=newest)
    if bound is not None:
        found = [e for e in found if (e[0] > bound if newest else e[0] < bound)]
    at = float(start[0]) if start else None
    dropped = 0
    while found and dropped < skip and found[0][0] == at:
        found.pop(0)
        dropped += 1
    page, rest = found[:limit], found[limit:]
    cursor = None
    if page and (rest or more or bound is not None):
        last = page[-1][0]
        seen = sum(1 for e in page if e[0] == last) + (dropped if last == at else 0)
        cursor = f"{last:.17g}:{seen}"
    elif bound is not None:
        cursor = f"{bound:.17g}:0"
    return page, cursor, scanned


def _same(score: float, cursor_score: str) -> bool:
    try:
        return score == float(cursor_score)
    except ValueError:
        return False
