"""Redis Cluster groundwork (issue 13): a real local cluster started from the tests'
server binary, cluster broker URLs read in ``connections``, the client, CLI and
dashboard on a cluster, and what a cluster refuses with one line (``wait_replicas``).
Workers and producers on a cluster: tests/integration/test_cluster_workers.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from typing import Any

import pytest
import redis
from celery import Celery
from redis.cluster import RedisCluster
from redis.crc import key_slot

from celery_ext.admin.web import create_app
from celery_ext.client import Client
from celery_ext.config import ConfigError
from celery_ext.store.connections import CLUSTER_NO_WAIT, cluster_client, cluster_config
from celery_ext.store.keys import Keys
from celery_ext.testing.server import ClusterGroup
from tests.helpers import REPO_ROOT, celery_cli, free_port, wait_for

with warnings.catch_warnings():  # Starlette >= 1.x would rather use httpx2; httpx still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient


def enqueue(client: Client, queue: str, payload: str) -> None:
    """Enqueue a raw payload with the producers' script, through the cluster client: in
    the queue's copy of the layout, the queue in the home registry (docs/cluster.md)."""
    k = client.keys.of(queue)
    client.scripts("enqueue", [k.queue(queue), k.ready, k.queues],
                   [payload, queue, k.wake_channel, 0])
    client.client.sadd(client.keys.queues, queue)


# -- connections: the cluster URL --------------------------------------------------------------


def test_cluster_url_is_read_like_kombus() -> None:
    config = cluster_config(["celery-ext://:s3cret@h1:7000/0;celery-ext://h2"],
                            {"cluster": True})
    assert config is not None
    assert config.seeds == (("h1", 7000), ("h2", 6379))
    assert (config.password, config.tls) == ("s3cret", False)
    tls = cluster_config(["celery-exts://h1:7000?ssl_cert_reqs=none"], {"cluster": "true"})
    assert tls is not None and tls.tls and tls.query["ssl_cert_reqs"] == "none"
    assert cluster_config(["celery-ext://h1:7000/0"], {}, environ={}) is None
    assert cluster_config(["celery-ext://h1:7000/3"], {"cluster": False}, environ={}) is None
    # CELERY_EXT_CLUSTER overrides the option, as CELERY_EXT_<SETTING> variables do.
    assert cluster_config(["celery-ext://h1"], {}, environ={"CELERY_EXT_CLUSTER": "1"})
    assert cluster_config(["celery-ext://h1"], {"cluster": True},
                          environ={"CELERY_EXT_CLUSTER": "0"}) is None


@pytest.mark.parametrize(("url", "options", "needle"), [
    ("celery-ext://:s3cret@h1:7000/2", {"cluster": True}, "a Redis Cluster has only db 0"),
    ("celery-ext+sentinel://:s3cret@h1:26379", {"cluster": True, "master_name": "m"},
     "not sentinels"),
    ("celery-ext://:s3cret@h1:7000/0", {"cluster": "maybe"}, "must be true or false"),
])
def test_bad_cluster_config_is_one_line_without_password(url: str, options: dict[str, object],
                                                         needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        cluster_config([url], options)
    message = str(exc.value)
    assert needle in message
    assert "s3cret" not in message and "\n" not in message


# -- the cluster itself --------------------------------------------------------------------------


def test_keys_spread_over_masters_and_survive_a_master_kill(cluster: ClusterGroup,
                                                            cluster_url: str) -> None:
    config = cluster_config([cluster_url], {"cluster": True})
    assert config is not None
    rc = cluster_client(config, {"socket_timeout": 2.0})
    masters = cluster.master_servers()
    assert len(masters) == 3 and len(cluster.replica_servers()) == 3
    tagged = [f"{{q{i}}}:k" for i in range(30)]
    for key in tagged:
        rc.set(key, key)
    assert {cluster.master_of(key) for key in tagged} == set(masters)

    key = tagged[0]
    victim = cluster.master_of(key)
    with victim.client() as c:
        assert c.wait(1, 5000) == 1  # the replica has the key before the crash
    cluster.kill_master(victim)
    try:
        promoted = cluster.wait_promoted(victim)
        assert cluster.master_of(key) is promoted
        # redis-py finds the new owner of the slot (MOVED / a refreshed topology).
        assert wait_for(lambda: _get(rc, key), 10, "the key on the promoted replica") == key
    finally:
        victim.start()  # it rejoins from its nodes.conf, as a replica of the promoted one
        wait_for(lambda: cluster.healthy() and len(cluster.replica_servers()) == 3, 20,
                 "the killed master to rejoin as a replica")
        rc.close()


def _get(rc: RedisCluster, key: str) -> str | None:
    try:
        value = rc.get(key)
    except redis.RedisError:
        return None
    return value.decode() if value is not None else None


# -- client, CLI and dashboard on a cluster ------------------------------------------------------


def test_client_cli_and_dashboard_read_a_cluster(cluster_url: str) -> None:
    client = Client.from_url(cluster_url, cluster=True, namespace="cl_view")
    try:
        assert client.ping()
        for n in range(3):
            enqueue(client, "tests.apps.proj.add", json.dumps({"n": n}))
        sizes = {q["name"]: q["size"] for q in client.job_queues()}
        assert sizes == {"tests.apps.proj.add": 3}
        assert client.counts()["dead"] == 0

        out = celery_cli("-A", "tests.apps.proj", "ext", "queues", "--json", broker_url=cluster_url,
                         env={"CELERY_EXT_CLUSTER": "1", "CELERY_EXT_NAMESPACE": "cl_view"})
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        items = rows["items"] if isinstance(rows, dict) else rows
        assert [(q["name"], q["size"]) for q in items] == [("tests.apps.proj.add", 3)]

        with TestClient(create_app(client, sample_interval=0.2)) as tc:
            page = tc.get("/api/queues").json()
        assert [(q["name"], q["size"]) for q in page["items"]] == [("tests.apps.proj.add", 3)]
    finally:
        k = client.keys.of("tests.apps.proj.add")
        client.client.delete(k.queue("tests.apps.proj.add"), k.ready, k.queues)
        client.client.delete(client.keys.queues)
        client.client.close()


def test_client_for_app_builds_a_cluster_client(cluster_url: str) -> None:
    app = Celery("cl", broker=cluster_url)
    app.conf.broker_transport_options = {"cluster": True, "namespace": "cl_app"}
    client = Client.for_app(app)
    try:
        assert client.app is app and client.keys == Keys("cl_app", cluster=True)
        assert client.ping() and client.job_queues() == []
    finally:
        client.client.close()


# -- what a cluster refuses ----------------------------------------------------------------------


def test_worker_with_wait_replicas_on_a_cluster_stops_with_one_line(cluster_url: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CELERY_EXT_BROKER_URL": cluster_url,
           "CELERY_EXT_CLUSTER": "1", "CELERY_EXT_WAIT_REPLICAS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.proj", "worker", "-P", "solo",
         "--without-mingle", "--without-gossip"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert CLUSTER_NO_WAIT in output.splitlines()
    assert "Traceback" not in output


def test_producer_with_wait_replicas_on_a_cluster_is_refused(cluster_url: str) -> None:
    app = Celery("cl", broker=cluster_url)
    app.conf.broker_transport_options = {"cluster": True, "wait_replicas": 1}
    with pytest.raises(ConfigError, match="wait_replicas is not available on a cluster"), \
            app.connection_for_write() as conn:
        conn.default_channel  # noqa: B018 - building the channel is what is refused


def test_client_reaches_a_password_cluster_with_the_urls_password() -> None:
    with ClusterGroup(masters=3, password="s3cret") as group:
        url = group.url()
        assert ":s3cret@" in url
        client = Client.from_url(url, cluster=True, namespace="cl_auth")
        try:
            assert client.ping() and client.job_queues() == []
        finally:
            client.client.close()
        with pytest.raises(redis.ConnectionError, match="invalid username-password"):
            Client.from_url(url.replace("s3cret", "wrong"), cluster=True)


def test_cli_says_in_one_line_that_no_seed_answers() -> None:
    out = celery_cli("-A", "tests.apps.proj", "ext", "queues",
                     broker_url=f"celery-ext://:s3cret@127.0.0.1:{free_port()}/0",
                     env={"CELERY_EXT_CLUSTER": "1"})
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: cannot reach Redis"), out.stderr
    assert "s3cret" not in out.stderr


def test_an_empty_slot_moves_to_another_master(cluster: ClusterGroup) -> None:
    """The operator's move bench.cluster --rebalance makes: a whole empty slot changes
    master, and clients follow (MOVED)."""
    key = "{move-me-7f3a}:k"
    source = cluster.master_of(key)
    target = next(m for m in cluster.master_servers() if m is not source)
    slot = key_slot(key.encode())
    rc = cluster_client(cluster_config([cluster.url()], {"cluster": True}) or _no_config(),
                        {"socket_timeout": 2.0})
    try:
        cluster.move_empty_slot(slot, target)
        assert cluster.master_of(key) is target
        rc.set(key, "v")  # redis-py follows the MOVED to the new owner
        assert cluster.master_of(key).client().get(key) == b"v"
        rc.delete(key)
    finally:
        cluster.move_empty_slot(slot, source)
        rc.close()


def _no_config() -> Any:
    raise AssertionError("the cluster option was not read")
