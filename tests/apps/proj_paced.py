"""Test app for per-key rate limits and throttling from a job (``-A tests.apps.proj_paced``:
``tests.apps.proj``'s app plus the tasks below). Each records its runs in db 2 of the
broker's server, stamped with that server's clock (Redis ``TIME``, µs): the clock the
limits are kept on.

Every task has a job queue of its own (``queue=``), so a drop-in producer reaches it too
and a drop-in worker consumes it with ``-Q``.
"""

from __future__ import annotations

from tests.apps.proj import app, recorder

#: The per-key rate limit of ``paced``; the tests read it from here.
KEY_RATE = "5/s"


def stamp() -> int:
    """Now on the broker server's clock, in µs."""
    seconds, micros = recorder().time()
    return int(seconds) * 1_000_000 + int(micros)


@app.task(queue="paced", fair_by=lambda tenant, n: tenant, fair_rate_limit=KEY_RATE,
          ignore_result=True)
def paced(tenant: str, n: int) -> None:
    """Append the start's Redis time to "paced:<tenant>"."""
    recorder().rpush(f"paced:{tenant}", stamp())
