"""Property-based tests (hypothesis) for the pure parts and the record formats.

* the weighted scheduler (:mod:`celery_ext.transport.round_robin`) as a state machine: whatever
  sequence of set_queues / activate / deactivate / picks, it picks only active
  queues, its bookkeeping matches a model, two samplers fed the same operations
  pick the same queues, and no active queue waits more than twice the total weight;
* key building (:mod:`celery_ext.store.keys`): one hash slot per namespace, whatever the
  names; distinct (kind, name) pairs give distinct keys; ``queue_name`` inverts
  ``queue``;
* the job's way through Redis: the envelope a producer writes (Kombu JSON, as
  ``Channel._put`` encodes it), the tag and ``"<queue>\\n<payload>"`` in-flight record
  the fetch script makes of it, and the ``"<meta json>\\n<queue>\\n<payload>"`` dead
  record (``dead.split_record``) round-trip exactly, on the real server's scripts.

(``tests/unit/test_sampler.py`` has the window and share guarantees of the sampler.)
"""

from __future__ import annotations

import base64
import json
import math
import uuid
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kombu.transport.virtual.base import Channel as VirtualChannel
from kombu.transport.virtual.base import Message as KombuMessage
from kombu.utils.json import dumps
from redis.crc import key_slot

from celery_ext.client import Client
from celery_ext.config import DEFAULT_PRIORITY_STEPS, Settings
from celery_ext.store.dead_set import dead_letter, parse_dead_record, split_record
from celery_ext.store.envelope import envelope_problem
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.transport.fetch import body_problem
from celery_ext.transport.round_robin import WeightedRoundRobin

# -- the weighted scheduler --------------------------------------------------------------------

NAMES = st.sampled_from([f"q{i}" for i in range(8)])


class SamplerMachine(RuleBasedStateMachine):
    """Random operations on a sampler, checked against a plain model (weights and the
    active set) and against a twin sampler given the same operations."""

    @initialize(weights=st.dictionaries(NAMES, st.integers(1, 6), max_size=6))
    def start(self, weights: dict[str, int]) -> None:
        self.sampler = WeightedRoundRobin(weights)
        self.twin = WeightedRoundRobin(weights)
        self.weights = dict(weights)
        self.active = set(weights)

    @rule(weights=st.dictionaries(NAMES, st.integers(1, 6), max_size=6), activate=st.booleans())
    def set_queues(self, weights: dict[str, int], activate: bool) -> None:
        for s in (self.sampler, self.twin):
            s.set_queues(weights, activate=activate)
        self.active &= set(weights)
        if activate:
            self.active |= set(weights) - set(self.weights)
        self.weights = dict(weights)

    @rule(name=NAMES)
    def activate(self, name: str) -> None:
        done = self.sampler.activate(name)
        assert self.twin.activate(name) == done
        assert done == (name in self.weights)  # only consumed queues can be active
        if done:
            self.active.add(name)

    @rule(name=NAMES)
    def deactivate(self, name: str) -> None:
        for s in (self.sampler, self.twin):
            s.deactivate(name)
        self.active.discard(name)

    @rule(n=st.integers(0, 40))
    def take(self, n: int) -> None:
        picks = self.sampler.take(n)
        assert picks == self.twin.take(n)  # deterministic
        assert len(picks) == (n if self.active else 0)
        assert set(picks) <= self.active

    @rule()
    def nobody_starves(self) -> None:
        """Whatever came before, every active queue is picked within 2 W picks."""
        if not self.active:
            assert self.sampler.pick() is None and self.twin.pick() is None
            return
        total = sum(self.weights[q] for q in self.active)
        picks = self.sampler.take(2 * total)
        assert picks == self.twin.take(2 * total)
        assert set(picks) == self.active, (picks, self.active, self.weights)

    @invariant()
    def matches_the_model(self) -> None:
        s = self.sampler
        assert s.active == self.active and s.queues == set(self.weights)
        assert s.has_active() == bool(self.active)
        # Weight classes: one per distinct weight of the active queues, members by weight.
        by_weight: dict[int, set[str]] = {}
        for q in self.active:
            by_weight.setdefault(self.weights[q], set()).add(q)
        assert {w: set(c.members) for w, c in s._classes.items()} == by_weight
        assert s._total == sum(self.weights[q] for q in self.active)


TestSamplerMachine = SamplerMachine.TestCase
TestSamplerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@settings(max_examples=200, deadline=None)
@given(weights=st.dictionaries(NAMES, st.integers(1, 9), min_size=1, max_size=8),
       rounds=st.integers(1, 4))
def test_shares_over_whole_periods_equal_the_weights(weights: dict[str, int],
                                                     rounds: int) -> None:
    sampler = WeightedRoundRobin(weights)
    total = sum(weights.values())
    assert Counter(sampler.take(rounds * total)) == {q: rounds * w for q, w in weights.items()}


# -- settings ----------------------------------------------------------------------------------

absurd = (st.integers(-10**12, 10**12) | st.floats(allow_nan=True, allow_infinity=True)
          | st.booleans() | st.text(max_size=8) | st.none()
          | st.sampled_from(["nan", "inf", "-1", "0", "1e9", "2.5", " 3 ", "", "soon"]))
FLOAT_FIELDS = [f for f in Settings.option_names()
                if isinstance(getattr(Settings(), f), float)]


@settings(max_examples=500, deadline=None)
@given(options=st.dictionaries(st.sampled_from([n for n in Settings.option_names()
                                                if n != "namespace"]), absurd, max_size=4))
def test_absurd_settings_are_refused_by_name_or_give_usable_settings(
        options: dict[str, Any]) -> None:
    """Negative or zero intervals, NaN, infinity, booleans, words: either one
    ConfigError naming a setting it got, or settings every component can run on."""
    try:
        s = Settings.load(options, environ={})
    except ValueError as exc:
        assert "\n" not in str(exc)
        assert any(name in str(exc) for name in [*options, "dead_after", "heartbeat_interval"])
        return
    for name in FLOAT_FIELDS:
        assert math.isfinite(getattr(s, name)), name
    for name in ("heartbeat_interval", "dead_after", "reap_interval", "idle_refresh_interval",
                 "promote_interval", "unique_ttl", "retry_backoff_base", "retry_backoff_max",
                 "dead_max_age"):
        assert getattr(s, name) > 0, name
    assert s.dead_after >= 2 * s.heartbeat_interval
    assert s.fetch_batch >= 1 and s.default_weight >= 1 and s.dead_max_size >= 1
    assert s.max_recoveries >= 0 and s.promote_batch >= 1 and s.max_payload_bytes >= 0
    assert 0 <= s.retry_backoff_jitter <= 1
    assert 0 <= s.promote_min_interval <= s.promote_interval
    int(s.dead_max_age * 1000)  # as the dead script's argument: no overflow


# -- key building ------------------------------------------------------------------------------

namespaces = st.from_regex(r"\A[A-Za-z0-9_.:-]{1,64}\Z")
# Any name a user or a pool could bring, braces, newlines and colons included.
names = st.text(min_size=0, max_size=40)

DYNAMIC = ("queue", "pool", "inflight", "busy", "unique", "cursor")
FIXED = ("ready", "queues", "weights", "pools", "inflight_pools", "redelivery",
         "reaper_lock", "checkins", "stop_requests", "stats", "running", "dead", "dead_jobs",
         "scheduled", "retry", "scheduled_jobs", "requeuer_lease", "paused", "limits")
CHANNELS = ("wake_channel", "schedule_channel")


def all_keys(keys: Keys, name: str) -> dict[tuple[str, str], str]:
    out = {(kind, name): getattr(keys, kind)(name) for kind in DYNAMIC}
    out.update({(kind, ""): getattr(keys, kind) for kind in FIXED})
    return out


@settings(max_examples=300, deadline=None)
@given(ns=namespaces, name=names)
def test_every_key_of_a_namespace_is_in_one_hash_slot(ns: str, name: str) -> None:
    keys = Keys(Settings(namespace=ns).namespace)  # the namespaces Settings accepts
    built = all_keys(keys, name)
    slots = {key_slot(k.encode()) for k in built.values()}
    assert slots == {key_slot(f"{{{ns}}}".encode())}, built
    for key in (*built.values(), *(getattr(keys, c) for c in CHANNELS)):
        assert key.startswith(f"{{{ns}}}:")


@settings(max_examples=300, deadline=None)
@given(ns=st.text(max_size=70) | st.from_regex(r"^[A-Za-z0-9_.:{}-]{1,64}$"))
def test_settings_accept_only_namespaces_that_make_one_hash_tag(ns: str) -> None:
    try:
        Settings(namespace=ns)
    except ValueError:
        return
    assert 1 <= len(ns) <= 64 and not set(ns) & set("{}\n\r\t ")


@settings(max_examples=300, deadline=None)
@given(ns=namespaces, a=names, b=names)
def test_distinct_kinds_and_names_never_share_a_key(ns: str, a: str, b: str) -> None:
    keys = Keys(ns)
    built = {**all_keys(keys, a), **all_keys(keys, b)}
    by_key: dict[str, set[tuple[str, str]]] = {}
    for what, key in built.items():
        by_key.setdefault(key, set()).add(what)
    assert all(len(owners) == 1 for owners in by_key.values()), by_key
    assert keys.queue_name(keys.queue(a)) == a


@settings(max_examples=200, deadline=None)
@given(ns1=namespaces, ns2=namespaces, name=names)
def test_namespaces_never_share_a_key(ns1: str, ns2: str, name: str) -> None:
    if ns1 == ns2:
        return
    first, second = all_keys(Keys(ns1), name), all_keys(Keys(ns2), name)
    assert not set(first.values()) & set(second.values())


# -- the job's records through the real scripts ------------------------------------------------

K = Keys("celery_ext")
POOL = "prop-pool"
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
queue_names = st.text(min_size=1, max_size=30).filter(lambda q: "\n" not in q)


def kombu_message(tag: str, queue: str, headers: dict[str, Any], body: str) -> dict[str, Any]:
    """A message dict in the order Kombu builds it (properties last)."""
    return {"body": body, "content-encoding": "utf-8", "content-type": "application/json",
            "headers": headers,
            "properties": {"correlation_id": tag, "body_encoding": "base64",
                           "delivery_info": {"exchange": "", "routing_key": queue},
                           "priority": 0, "delivery_tag": tag}}


@pytest.fixture
def scripts(redis_client: redis.Redis) -> Scripts:
    return Scripts(redis_client)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(queue=queue_names, headers=st.dictionaries(st.text(max_size=15), json_values, max_size=6),
       body=st.text(max_size=200), error=st.text(max_size=80),
       meta=st.dictionaries(st.sampled_from(["name", "task_id", "exc_type", "x"]),
                            st.text(max_size=20), max_size=4))
def test_envelope_inflight_and_dead_records_round_trip(
        redis_client: redis.Redis, scripts: Scripts, queue: str, headers: dict[str, Any],
        body: str, error: str, meta: dict[str, Any]) -> None:
    """Whatever the headers (a ``delivery_tag`` header, quotes, newlines included), the
    fetch script finds the message's own tag, keeps the payload byte for byte in the
    in-flight record, and the dead record gives back meta, queue and payload."""
    tag = str(uuid.uuid4())
    headers = {"delivery_tag": "not-this-one", **headers}  # properties' tag must win
    payload = dumps(kombu_message(tag, queue, headers, body))  # as Channel._put encodes
    redis_client.zadd(K.pools, {POOL: 1})
    scripts("enqueue", [K.queue(queue), K.ready, K.queues], [payload, queue, K.wake_channel, 0])

    keys = K.fetch(POOL, [queue], DEFAULT_PRIORITY_STEPS)
    status, jobs, *_ = scripts("fetch", keys, [POOL, "1", queue])
    assert status == 1 and len(jobs) == 1
    qname, got_tag, got_payload, recoveries = jobs[0]
    assert (qname.decode(), got_tag.decode(), got_payload.decode(), recoveries) == \
        (queue, tag, payload, -1)
    record = redis_client.hget(K.inflight(POOL), tag)
    assert record == f"{queue}\n{payload}".encode()
    assert json.loads(payload)["headers"] == headers  # the envelope decodes to what was sent

    assert dead_letter(redis_client, Settings(), POOL, tag, reason="failed", error=error, **meta)
    raw = redis_client.hget(K.dead_jobs, tag)
    assert raw is not None
    got_meta, got_queue, got_payload2 = split_record(raw)
    assert (got_queue, got_payload2) == (queue, payload)
    assert got_meta == {"reason": "failed", "error": error, "pool": POOL, **meta}
    parsed = parse_dead_record(raw)
    assert (parsed["queue"], parsed["payload"], parsed["error"]) == (queue, payload, error)
    job = Client(redis_client).dead_job(tag)
    assert job is not None and job["queue"] == queue and job["payload"] == payload
    assert redis_client.hlen(K.inflight(POOL)) == 0
    assert int(redis_client.hget(K.running, queue) or 0) == 0
    redis_client.flushdb()


def _field(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field of a Kombu envelope: usually the right type, sometimes any JSON."""
    return st.one_of(inner, json_values)


envelopes = st.fixed_dictionaries({}, optional={
    "body": _field(st.text(max_size=20) | st.binary(max_size=20).map(
        lambda b: base64.b64encode(b).decode())),
    "content-type": _field(st.just("application/json")),
    "content-encoding": _field(st.just("utf-8")),
    "headers": _field(st.dictionaries(st.sampled_from(["task", "id", "eta"]), json_values)),
    "properties": _field(st.fixed_dictionaries({"delivery_tag": st.text(max_size=5)}, optional={
        "body_encoding": _field(st.sampled_from(["base64", "utf-8", "rot13"])),
        "delivery_info": _field(st.fixed_dictionaries({"routing_key": st.text(max_size=5)})),
    })),
}) | json_values


@settings(max_examples=500, deadline=None)
@given(raw=envelopes)
def test_an_envelope_that_passes_the_checks_makes_a_kombu_message(raw: Any) -> None:
    """The transport's shape and body checks are enough for Kombu: whatever passes them
    becomes a Message without raising (what failed there stopped the worker)."""
    channel = SimpleNamespace(codecs=VirtualChannel.codecs)
    channel.decode_body = lambda body, enc=None: VirtualChannel.decode_body(channel, body, enc)
    problem = envelope_problem(raw) or body_problem(channel, raw)
    if problem is not None:
        assert isinstance(problem, str) and "\n" not in problem
        return
    raw["properties"]["delivery_tag"] = "t"  # as Fetcher.decode does (fetch's tag)
    message = KombuMessage(raw, channel=channel)
    assert message.headers is None or isinstance(message.headers, dict)
    assert message.delivery_info is None or isinstance(message.delivery_info, dict)
    assert message.body is None or isinstance(message.body, bytes | str)


@settings(max_examples=300, deadline=None)
@given(meta=st.dictionaries(st.text(max_size=10), json_values, max_size=5),
       queue=queue_names, payload=st.text(max_size=200))
def test_split_record_inverts_the_record_format(meta: dict[str, Any], queue: str,
                                                payload: str) -> None:
    """The format the dead and schedule scripts write: meta JSON is one line (newlines
    escaped), the queue name has none, the payload may have any."""
    line = json.dumps(meta, separators=(",", ":"))
    raw = f"{line}\n{queue}\n{payload}"
    assert split_record(raw) == (meta, queue, payload)
    assert split_record(raw.encode()) == (meta, queue, payload)
