"""Redis ``TIME`` as the one clock: host clocks may be skewed, the server's is shared."""

from __future__ import annotations

from typing import Any


def now_ms(client: Any) -> int:
    """Current Redis server time in milliseconds."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def now_s(client: Any) -> float:
    """Current Redis server time in seconds (float)."""
    seconds, micros = client.time()
    return int(seconds) + int(micros) / 1_000_000
