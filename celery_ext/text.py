"""Text from messages and errors made fit for one log line or one table cell.

Job ids, names and error texts can come from a hostile or broken message; every module
that logs or prints them passes them through :func:`one_line` first.
"""

from __future__ import annotations


def one_line(text: str, limit: int = 500) -> str:
    """``text`` fit for one log line: whitespace runs (newlines included) become one
    space and other control characters "?" (it may come from a hostile message:
    no forged log lines, no terminal escapes), cut to ``limit`` characters."""
    text = " ".join(text.split())
    if not text.isprintable():
        text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[:limit - 1] + "…"
