"""History and search in a real browser (headless Chromium, see ``tests.browserutil``):
the plots survive a dashboard restart (their data are in Redis), and a search in a
10,000-job dead set finds 37 jobs whose retry puts them back in their queue while
the rest stays. Screenshots go to the test's tmp dir (``screenshots/``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ext.store.keys import Keys
from tests.apps import proj_web
from tests.browserutil import Page, browser
from tests.webutil import env_for, fill_dead, start_web, stop_all, wait_for
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

__all__ = ["browser"]  # the fixture, imported for pytest

K = Keys("celery_ext")


def _chart_max(page: Any, title_prefix: str) -> float:
    return float(page.locator(f'[data-chart^="{title_prefix}"]').get_attribute("data-max"))


def test_plots_survive_a_dashboard_restart(browser: Any, broker_url: str,
                                           redis_client: redis.Redis, tmp_path: Path,
                                           worker_factory: Callable[..., WorkerProcess]) -> None:
    proj_web.configure(broker_url)
    worker_factory(proj_web.__name__, concurrency=2, env=env_for(
        broker_url, CELERY_EXT_HISTORY_SAMPLE_INTERVAL="0.5")).start()
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"screenshots in {shots}")
    for r in [proj_web.echo.delay(i) for i in range(8)]:
        r.get(timeout=20)
    proj_web.echo.apply_async(("later",), countdown=600)  # a queue-size sample above zero
    key = K.history_minute(0)[:-1]
    wait_for(lambda: any(b"q" in redis_client.hkeys(k) for k in redis_client.scan_iter(key + "*")),
             what="a queue-size sample in the history")
    web, base = start_web(broker_url, tmp_path)
    try:
        ui = Page(browser, base, shots)
        page = ui.open("/")
        page.wait_for_function(
            "Number(document.querySelector('[data-chart^=\"Throughput\"]').dataset.max) > 0")
        ui.shot("overview-before-restart")
        ui.context.close()
    finally:
        stop_all([web])

    # A new dashboard process: its first page load already has the plots.
    web, base = start_web(broker_url, tmp_path)
    try:
        ui = Page(browser, base, shots)
        page = ui.open("/", "overview-after-restart")
        assert _chart_max(page, "Throughput") > 0
        assert _chart_max(page, "Runtime") > 0
        # Jobs of a few milliseconds: the runtime axis is in ms, each tick its own label
        # (every tick read "0.00" when they were written in seconds).
        ticks = page.locator('[data-chart="Runtime"] text.y-tick').all_text_contents()
        assert len(ticks) == 5 and len(set(ticks)) == 5, ticks
        assert ticks[-1].endswith(" ms"), ticks
        assert _chart_max(page, "Queue sizes") >= 1  # the scheduled job
        page.locator('[data-window="24h"]').click()
        page.locator('[data-window="24h"].active').wait_for()
        assert _chart_max(page, "Throughput") > 0
        ui.shot("overview-24h")
        ui.assert_clean()
        ui.context.close()
    finally:
        stop_all([web])
    print("\n".join(str(p) for p in sorted(shots.iterdir())))


def test_search_10000_dead_jobs_and_retry_37(browser: Any, broker_url: str,
                                             redis_client: redis.Redis, tmp_path: Path) -> None:
    # 10,000 dead jobs of 4 job names and 2 error types; "acme" appears in the arguments
    # of 37 billing.charge/CardDeclined jobs, and of others that the filters exclude.
    jobs = []
    for i in range(10_000):
        name = ("billing.charge", "billing.refund", "mail.send", "report.build")[i % 4]
        exc = "CardDeclined" if i % 8 == 0 else "TimeoutError"
        customer = ("acme" if (i % 8 == 0 and i < 37 * 8) or (i % 97 == 1 and i % 8)
                    else "globex")
        jobs.append((f"job-{i:05d}", name, exc, [f"{customer}-order-{i}", i]))
    fill_dead(redis_client, jobs)
    assert redis_client.zcard(K.dead) == 10_000
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"screenshots in {shots}")
    web, base = start_web(broker_url, tmp_path)
    try:
        ui = Page(browser, base, shots)
        page = ui.open("/dead")
        page.fill("[data-testid=search-name]", "billing.charge")
        page.fill("[data-testid=search-error]", "CardDeclined")
        page.fill("[data-testid=search-text]", "acme-order")
        page.click('[data-action="search"]')
        page.locator("[data-testid=match-count]", has_text="37 matching").wait_for()
        assert page.locator("#content tbody tr").count() == 37
        assert "acme-order" in page.locator("#content tbody").inner_text()
        ui.shot("dead-search")
        page.click('[data-action="dead-retry-matching"]')  # the confirm dialog is accepted
        page.locator("[data-testid=search-result]", has_text="Retried 37").wait_for()
        page.locator("td.empty", has_text="No dead job matches").wait_for()
        ui.shot("dead-search-after-retry")
        ui.assert_clean()
        ui.context.close()
    finally:
        stop_all([web])
    assert redis_client.llen(K.queue("billing.charge")) == 37
    assert redis_client.zcard(K.dead) == 10_000 - 37
    for q in ("billing.refund", "mail.send", "report.build"):
        assert redis_client.llen(K.queue(q)) == 0
    print("\n".join(str(p) for p in sorted(shots.iterdir())))
