"""The fault scenarios: which faults a run injects, against what.

A scenario names fault kinds (``harness.POOL_FAULTS`` and the rest, injected in turn)
and what the run is made of: the server (one, Sentinel, a cluster), the pools'
execution pool, drop-in mode, the app's ack settings. ``harness.Run`` runs one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    kinds: tuple[str, ...]
    appendfsync: str = "always"
    #: What ours must show: no job lost (everysec may lose the last second of writes).
    promise_no_loss: bool = True
    #: The proxied pool's execution pool and concurrency, if not prefork like the others.
    proxied_pool: tuple[str, int] | None = None
    #: Every pool's execution pool and concurrency, if not prefork with
    #: ``Options.concurrency`` (``proxied_pool`` still wins for the proxied one).
    pool: tuple[str, int] | None = None
    #: How long most jobs take, if not ``Options.short_seconds``.
    short_seconds: tuple[float, float] | None = None
    #: Drop-in mode: neither the workers' app nor the producer's calls install(app)
    #: (ours; stock never does), so every job goes to Celery's ``celery`` queue.
    dropin: bool = False
    #: The app sets task_acks_late and task_reject_on_worker_lost; False leaves them
    #: to Celery (acked when a job starts) or, if called, to install(app).
    acks_late: bool = True
    #: A primary, a replica and three sentinels instead of one server; every pool and
    #: the producer use the sentinel URL (stock ``sentinel://``, ours
    #: ``celery-ext+sentinel://`` with ``wait_replicas=1``). No proxy.
    sentinel: bool = False
    #: A local Redis Cluster of 3 masters with one replica each instead of one server
    #: (ours with the ``cluster`` option; no proxy), and this many job names, each its
    #: own job queue, spread over the masters by their hash slots.
    cluster: bool = False
    names: int = 1
    #: Jobs sent with a countdown (``Options.countdown_share``); off where the scheduled
    #: set is not what the scenario is about.
    countdowns: bool = True
    #: Why stock cannot run the scenario at all: its column says so instead of a figure.
    stock_not_run: str = ""
    #: Seconds from one fault to the next at least (a fault that takes longer than
    #: ``Options.interval`` would otherwise outlast the producer's window).
    min_interval: float = 0.0


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("kill_main", "SIGKILL a pool's main process mid-job", ("kill_main",)),
    Scenario("kill_child", "SIGKILL a prefork child mid-job", ("kill_child",)),
    Scenario("sigterm", "SIGTERM (warm shutdown) with jobs reserved", ("sigterm",)),
    Scenario("sigstop", "SIGSTOP a pool past dead_after, then SIGCONT", ("sigstop",)),
    Scenario("redis_kill", "SIGKILL Redis, restart from AOF (appendfsync always)",
             ("redis_kill",)),
    Scenario("redis_kill_everysec", "SIGKILL Redis, restart from AOF (appendfsync everysec)",
             ("redis_kill",), appendfsync="everysec", promise_no_loss=False),
    Scenario("redis_stall", "Redis stalls (DEBUG SLEEP, CLIENT PAUSE) past dead_after",
             ("debug_sleep", "client_pause")),
    Scenario("oom", "maxmemory reached with noeviction, then lifted", ("oom",)),
    Scenario("partition", "a pool cut off from Redis past dead_after, then reconnected",
             ("partition",)),
    Scenario("publish_cut", "the producer's connection dies after Redis ran an enqueue, "
             "before the reply", ("publish_cut",)),
    Scenario("soak", "all of the above in turn, in one run",
             ("kill_main", "sigstop", "kill_child", "redis_stall", "sigterm", "partition",
              "redis_kill", "oom")),
    # Faults inside a round trip, other pools and drop-in mode (not in soak).
    Scenario("fetch_reply_lost", "the proxied pool's fetch runs, its reply is lost",
             ("fetch_reply_lost",)),
    Scenario("threads_cut", "every connection of a threads pool cut briefly, under dead_after",
             ("cut",), proxied_pool=("threads", 4)),
    # Early acks: a running job was acked when it started and dies with the pool (its
    # prefork children get SIGKILL with the main process): lost by design.
    Scenario("kill_main_dropin", "SIGKILL a pool's main process, drop-in, Celery's early acks",
             ("kill_main",), dropin=True, acks_late=False, promise_no_loss=False),
    Scenario("kill_main_dropin_late",
             "SIGKILL a pool's main process, drop-in, the app sets acks_late",
             ("kill_main",), dropin=True),
    Scenario("ack_lost", "the proxied pool's ack never reaches Redis, reconnects refused 1 s",
             ("ack_lost",)),
    # Each fault waits (within its interval) until the hit client is answered again.
    Scenario("silent_connection", "a connection left half-open (no reply, no reset): the "
             "proxied pool's fetch (ran, reply swallowed), its ack (swallowed), the "
             "producer's enqueue (ran, reply swallowed)",
             ("fetch_silent", "ack_silent", "publish_silent"), min_interval=15.0),
    Scenario("sentinel_failover", "SIGKILL the primary under Sentinel; a replica takes over",
             ("sentinel_failover",), sentinel=True),
    # Countdowns off: promoting the scheduled sets of every queue's copy on a cluster is
    # the requeuer's (tests/test_cluster_*.py); this scenario is about the job queues.
    Scenario("cluster_failover", "SIGKILL the cluster master holding the most job queues; "
             "its replica takes over", ("cluster_failover",), cluster=True, names=30,
             countdowns=False, min_interval=8.0,
             stock_not_run="Kombu's redis transport has no cluster support (celery#2852)"),
)}

#: The scale soak (``--scale-soak``, tests/faults/scale.py): near-no-op jobs, a SIGKILL of a
#: pool's main process spread over them, prefork and threads in turn; no countdowns (the
#: scheduled set is not what it measures).
SCENARIOS.update((s.name, s) for s in (
    Scenario("scale_soak_prefork", "scale soak: SIGKILL prefork pools' main processes "
             "under a stream of near-no-op jobs", ("kill_main",), countdowns=False),
    Scenario("scale_soak_threads", "scale soak: SIGKILL threads pools under a stream of "
             "near-no-op jobs", ("kill_main",), pool=("threads", 4), countdowns=False),
))

#: The execution pool of the green variants: jobs are greenlets of the main process, as
#: many as a gevent user runs (issue 29).
GEVENT = ("gevent", 50)
#: How long most of their jobs take: a gevent user's jobs wait on I/O. Jobs of 5-30 ms
#: leave 50 greenlets idle, and a fault hits a pool running a handful of jobs (0-10 in
#: a measured run); jobs of 0.2-1 s keep the greenlets busy through the first faults.
GEVENT_SECONDS = (0.2, 1.0)


def on_gevent(base: Scenario) -> Scenario:
    """``base`` with every pool on ``-P gevent -c 50`` running longer jobs, named
    ``<name>_gevent``: the same fault where a pool's jobs share its main process, its
    clients and one event loop."""
    return replace(base, name=f"{base.name}_gevent", pool=GEVENT, proxied_pool=None,
                   short_seconds=GEVENT_SECONDS,
                   title=f"{base.title} (every pool -P gevent -c {GEVENT[1]})")


#: The short chaos scenarios again under gevent: a SIGKILL of the pool (its greenlets
#: die with it), a warm shutdown, a fetch reply lost, every connection cut briefly.
SCENARIOS.update((s.name, s) for s in (
    on_gevent(SCENARIOS["kill_main"]),
    on_gevent(SCENARIOS["sigterm"]),
    on_gevent(SCENARIOS["fetch_reply_lost"]),
    # threads_cut's fault with a gevent pool behind the proxy.
    on_gevent(Scenario("connection_cut", "every connection of the proxied pool cut briefly, "
                       "under dead_after", ("cut",))),
))
