"""Test app for bulk publishing (``-A tests.apps.proj_bulk``: ``tests.apps.proj``'s app plus
these tasks). Each job counts its runs in db 2 under its own field, so a test sees a
job that ran twice or never."""

from __future__ import annotations

from typing import Any

from tests.apps.proj import app, recorder


@app.task(ignore_result=True)
def tally(key: str, i: int) -> None:
    """Count one run of job ``i`` in the hash "bulk:<key>"."""
    recorder().hincrby(f"bulk:{key}", str(i), 1)


@app.task(ignore_result=True, fair_by=lambda key, tenant, i: tenant)
def tenant_tally(key: str, tenant: str, i: int) -> None:
    """As ``tally``, with a fair key per tenant."""
    recorder().hincrby(f"bulk:{key}", f"{tenant}{i}", 1)


@app.task(ignore_result=True, unique=True, unique_key=lambda key, name: f"{key}:{name}")
def unique_tally(key: str, name: str) -> Any:
    """As ``tally``, unique by ``name``."""
    recorder().hincrby(f"bulk:{key}", name, 1)


@app.task(ignore_result=True)
def fan_out(key: str, n: int) -> None:
    """Publishes ``n`` ``tally`` jobs with ``apply_many`` from inside a job (their parent)."""
    tally.apply_many([(key, i) for i in range(n)])
