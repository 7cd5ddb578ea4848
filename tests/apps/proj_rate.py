"""Test app for cluster-wide rate limits (workers run it as ``-A tests.apps.proj_rate``).

``tests.apps.proj``'s app plus a rate-limited task with a queue of its own (``queue=``, so
a drop-in producer reaches it too) and an unlimited one. Each records when it started
(``time.time()``: the tests and the workers share one machine) in db 2.
"""

from __future__ import annotations

import time

from tests.apps.proj import app, recorder

#: The limit of ``rated``; the tests read it from here.
RATE = "20/s"


@app.task(rate_limit=RATE, queue="rated", ignore_result=True)
def rated(key: str) -> None:
    recorder().rpush(f"runs:{key}", repr(time.time()))


@app.task(ignore_result=True)
def unrated(key: str) -> None:
    recorder().rpush(f"runs:{key}", repr(time.time()))
