"""config/: what a user deploys, one copy each, tested as it is deployed.

The server files are loaded by real servers: a primary with ``valkey-replicated.conf``
refuses writes until a replica (with the same file) is in sync, and the replica refuses
writes for good. The production ``celeryconfig.py`` names every setting of
:class:`celery_ext.config.Settings` with its current default (so it cannot drift from the
code), and a real worker configured from it runs a job whose result comes back through
celery-ext's result backend. The single-node file is loaded by test_compose.py (the
stack mounts it), the cluster file builds a real cluster there, and the Prometheus rules
and the Grafana dashboard are checked by test_metrics.py (promtool, a live Prometheus).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import pytest
import redis

from celery_ext.config import Settings
from tests.deploy_config import CONFIG, installed, server
from tests.helpers import wait_for
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

CELERYCONFIG = CONFIG / "celeryconfig.py"


def test_a_replicated_primary_takes_writes_only_with_a_replica_in_sync(tmp_path: Path) -> None:
    etc = installed(tmp_path / "etc")
    with server(etc / "valkey-replicated.conf", tmp_path / "primary") as primary:
        live = {k: v for k in ("appendonly", "maxmemory-policy", "min-replicas-to-write",
                               "min-replicas-max-lag", "replica-read-only")
                for k, v in primary.config_get(k).items()}
        assert live == {"appendonly": "yes", "maxmemory-policy": "noeviction",
                        "min-replicas-to-write": "1", "min-replicas-max-lag": "10",
                        "replica-read-only": "yes"}  # valkey.conf's, and its own
        with pytest.raises(redis.ResponseError, match="NOREPLICAS"):
            primary.set("job", "1")  # alone: a failover would lose what it took
        port = primary.connection_pool.connection_kwargs["port"]
        with server(etc / "valkey-replicated.conf", tmp_path / "replica",
                    "--replicaof", "127.0.0.1", str(port)) as replica:

            def accepted() -> bool:
                try:
                    return bool(primary.set("job", "1"))
                except redis.ResponseError:
                    return False

            wait_for(accepted, 30, "the primary to take a write once its replica is in sync")
            wait_for(lambda: replica.get("job") == "1", 15, "the write on the replica")
            with pytest.raises(redis.exceptions.ReadOnlyError):
                replica.set("job", "2")


def _celeryconfig() -> dict[str, object]:
    namespace: dict[str, object] = {}
    exec(compile(CELERYCONFIG.read_text(), str(CELERYCONFIG), "exec"), namespace)
    return namespace


def test_celeryconfig_names_every_setting_with_its_default() -> None:
    options = _celeryconfig()["broker_transport_options"]
    assert isinstance(options, dict)
    defaults = Settings()
    names = {f.name for f in fields(Settings)}
    assert set(options) == names, (f"config/celeryconfig.py lacks {sorted(names - set(options))}"
                                   f", names unknown {sorted(set(options) - names)}")
    text = CELERYCONFIG.read_text()
    for name in sorted(names):
        default = getattr(defaults, name)
        assert options[name] == default and type(options[name]) is type(default), \
            f"config/celeryconfig.py: {name} is {options[name]!r}, its default {default!r}"
        assert f"CELERY_EXT_{name.upper()}" in text, f"config/celeryconfig.py: {name}'s variable"
    assert Settings.load(options, environ={}) == defaults


def test_a_worker_configured_from_celeryconfig_runs_a_job(
        broker_url: str, worker_factory: Callable[..., WorkerProcess],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The app loads the file as a user would; the URLs come from the environment."""
    result_url = broker_url.rsplit("/", 1)[0] + "/1"
    env = {"CELERY_EXT_BROKER_URL": broker_url, "CELERY_EXT_RESULT_BACKEND": result_url}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from tests.apps import proj_deploy

    proj_deploy.app.conf.update(broker_url=broker_url, result_backend=result_url)
    worker_factory(proj_deploy.__name__, env=env).start()
    assert proj_deploy.app.conf.task_acks_late is True
    assert proj_deploy.add.delay(2, 3).get(timeout=30) == 5
