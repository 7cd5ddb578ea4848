"""The test apps' record clients (``tests.apps.record_client``), on a real server: the
jobs of a threads pool that start together all write their records.

A client made lazily in a module global without a lock is made more than once when jobs
start together (a ``-P threads`` pool meeting a backlog: the cluster failover test's). The
one the global drops is collected at once, and its ``Redis.__del__`` closes the pool
``from_url`` made for it, connections in use included: a job connecting through it finds
its new socket closed (``EBADF``) or mute in its handshake, and fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from celery_ext.testing.server import RedisServer
from tests.helpers import REPO_ROOT

#: Rounds, each on a record server URL the process has not used (a worker's first jobs).
ROUNDS = 30
#: Jobs that start together in each round (a threads pool's concurrency).
THREADS = 8
#: Seconds a round's record writes may take (milliseconds each when nothing is wrong).
WAIT = 20.0

#: In a process of its own, as a worker's jobs (the app's tasks stay out of this one's
#: Celery registry): each round, ``THREADS`` threads call the cluster app's record write
#: at once; prints the writes that failed and those still waiting after ``WAIT``.
WRITERS = textwrap.dedent("""
    import json, sys, threading, time

    from tests.apps import proj_cluster

    base, rounds, threads_n, wait = sys.argv[1], *map(int, sys.argv[2:4]), float(sys.argv[4])
    errors, stuck = [], 0
    # Threads switch inside the client's making, as those of a busy pool do.
    sys.setswitchinterval(1e-6)
    for n in range(rounds):
        proj_cluster.configure(proj_cluster.BROKER_URL, "records", f"{base}?client_name=r{n}")
        barrier = threading.Barrier(threads_n)

        def job(i, n=n, barrier=barrier):
            barrier.wait()
            try:
                proj_cluster._run("later", n * threads_n + i, 0.0)  # every job's record write
            except BaseException as exc:
                errors.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=job, args=(i,), daemon=True)
                   for i in range(threads_n)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + wait
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck += sum(t.is_alive() for t in threads)
        if errors or stuck:
            break
    print(json.dumps({"errors": errors, "stuck": stuck}), flush=True)
""")


def test_jobs_starting_together_all_write_their_records(redis_server: RedisServer) -> None:
    base = redis_server.url(db=8)  # (a db no other test uses)
    redis_server.client(db=8).flushdb()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", WRITERS, base, str(ROUNDS), str(THREADS), str(WAIT)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=WAIT * 2 + 60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert not out["errors"] and not out["stuck"], (
        f"of {ROUNDS * THREADS} record writes, {len(out['errors'])} failed and "
        f"{out['stuck']} still wait after {WAIT:g} s: {out['errors'][:3]}")
    runs = redis_server.client(db=8).mget([f"runs:later:{i}" for i in range(ROUNDS * THREADS)])
    assert [int(r or 0) for r in runs] == [1] * (ROUNDS * THREADS)
