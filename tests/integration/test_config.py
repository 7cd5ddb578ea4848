"""Settings: named defaults, env overrides, and clear errors for bad values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from celery_ext.config import ConfigError, Settings

ROOT = Path(__file__).resolve().parents[2]


def test_env_overrides_transport_options() -> None:
    s = Settings.load({"dead_after": 60, "namespace": "app1"},
                      environ={"CELERY_EXT_DEAD_AFTER": "12.5"})
    assert s.dead_after == 12.5 and s.namespace == "app1"
    assert s.heartbeat_interval == Settings().heartbeat_interval


@pytest.mark.parametrize("options, needle", [
    ({"namespace": "a{b}"}, "namespace"),
    ({"heartbeat_interval": 0}, "heartbeat_interval"),
    ({"dead_after": 1, "heartbeat_interval": 5}, "twice heartbeat_interval"),
    ({"max_recoveries": "lots"}, "max_recoveries"),
    ({"fetch_batch": 0}, "fetch_batch"),
])
def test_bad_settings_say_what_to_change(options: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        Settings.load(options, environ={})


def test_worker_with_bad_settings_exits_with_one_line(broker_url: str) -> None:
    env = {**os.environ, "CELERY_EXT_BROKER_URL": broker_url, "CELERY_EXT_DEAD_AFTER": "1",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.proj", "worker", "-P", "solo"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines()
             if ln.strip() and "SecurityWarning" not in ln and "superuser" not in ln]
    assert "Traceback" not in proc.stderr
    assert any("dead_after (1.0) must be at least twice heartbeat_interval" in ln for ln in lines)
