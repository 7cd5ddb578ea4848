"""The dashboard in a real browser: headless Chromium (Debian's ``chromium``) driven by
Playwright, against ``celery ext web`` and a real worker. Screenshots of every page
go to the test's tmp dir (``screenshots/``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ext.client import Client
from tests.apps import proj_web
from tests.browserutil import Page, browser
from tests.webutil import start_web, stop_all, wait_for
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

__all__ = ["browser"]  # the fixture, imported for pytest

XSS = "<script>window.__pwned=1</script><img src=x onerror=\"window.__pwned=2\">"


def test_dashboard_in_a_browser(browser: Any, broker_url: str, redis_client: redis.Redis,
                                tmp_path: Path,
                                worker_factory: Callable[..., WorkerProcess]) -> None:
    proj_web.configure(broker_url)
    client = Client.for_app(proj_web.app)
    worker_factory(proj_web.__name__, concurrency=2).start()
    web, base = start_web(broker_url, tmp_path)
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"screenshots in {shots}")
    try:
        for i in range(5):
            proj_web.echo.delay(i)
        dead_job = proj_web.fragile.delay("k-browser", XSS)
        proj_web.echo.apply_async(("later",), countdown=300)
        proj_web.flaky.delay("k-browser-retry", 300)
        running = proj_web.progress.delay(3000, 0.1)
        wait_for(lambda: client.counts() == {"scheduled": 1, "retry": 1, "dead": 1},
                 what="one job in each set")
        wait_for(lambda: any(b["progress"] for b in client.busy_workers()),
                 what="a checkin")
        ui = Page(browser, base, shots)

        page = ui.open("/")
        ui.refreshed()  # a second sample, so the plots have a line
        ui.shot("overview")
        assert page.locator(".card", has_text="Dead").inner_text().split()[-1] == "1"
        assert page.locator("[data-chart] svg path").count() >= 2
        ui.assert_clean()

        page = ui.open("/queues", "queues")
        row = page.locator('tr[data-row="tests.apps.proj_web.echo"]')
        row.locator("button", has_text="Pause").click()
        page.locator('tr[data-row="tests.apps.proj_web.echo"] .badge', has_text="paused").wait_for()
        assert "tests.apps.proj_web.echo" in client.paused()
        ui.shot("queues-paused")
        page.locator('tr[data-row="tests.apps.proj_web.echo"] button', has_text="Resume").click()
        page.locator('tr[data-row="tests.apps.proj_web.echo"] .badge', has_text="active").wait_for()
        assert client.paused() == []
        ui.assert_clean()

        page = ui.open("/pools", "pools")
        assert page.locator(".badge", has_text="running").count() == 1

        page = ui.open("/busy", "busy")
        busy_row = page.locator(f'tr[data-row="{running.id}"]')
        assert busy_row.locator(".progress").count() == 1
        assert "step" in busy_row.inner_text()
        busy_row.locator("button", has_text="Stop").click()
        assert running.get(timeout=20)["stopped_at"] < 3000
        ui.assert_clean()

        ui.open("/scheduled", "scheduled")
        assert "tests.apps.proj_web.echo" in ui.page.locator("#content").inner_text()
        ui.open("/retry", "retry")
        assert "tests.apps.proj_web.flaky" in ui.page.locator("#content").inner_text()

        page = ui.open("/dead", "dead")
        dead_id = client.dead()["items"][0]["id"]
        dead_row = page.locator(f'tr[data-row="{dead_id}"]')
        assert "<script>window.__pwned=1</script>" in dead_row.inner_text()  # shown as text
        ui.assert_clean()

        page = ui.open(f"/dead/{dead_id}", "dead-job")
        assert "RuntimeError" in page.locator("[data-testid=traceback]").inner_text()
        assert "<script>window.__pwned=1</script>" in page.locator(
            "[data-testid=dead-args]").inner_text()
        ui.assert_clean()

        page = ui.open(f"/demo?job={dead_job.id}")
        page.locator('[data-job-state="dead"]').wait_for()
        ui.shot("widget-dead")
        assert "<script>" in page.locator("[data-celery-ext-job]").inner_text()
        ui.assert_clean()

        # Retry the dead job from the dead page and see it run.
        redis.Redis.from_url(proj_web.backend_url(broker_url, db=2)).set("k-browser", 1)
        page = ui.open("/dead")
        page.locator(f'tr[data-row="{dead_id}"] button[data-action="dead-retry"]').click()
        page.locator("td.empty", has_text="The dead set is empty").wait_for()
        wait_for(lambda: proj_web.app.backend.get_task_meta(dead_job.id, cache=False)["status"]
                 == "SUCCESS", what="the retried job to succeed")
        ui.shot("dead-after-retry")
        ui.assert_clean()

        # A revoke lists its id, who made it and when it lapses.
        revoked_job = proj_web.echo.apply_async(("to-revoke",), countdown=300)
        proj_web.app.control.revoke(revoked_job.id)
        wait_for(lambda: [r["task_id"] for r in client.revoked()] == [revoked_job.id],
                 what="the revoke recorded")
        page = ui.open("/revoked", "revoked")
        revoked_row = page.locator(f'tr[data-row="{revoked_job.id}"]')
        assert "(celery control revoke)" in revoked_row.inner_text()
        ui.assert_clean()

        # A periodic entry set from the Periodic page's form; a bad one is refused there.
        page = ui.open("/periodic")
        form = page.locator("[data-testid=periodic-form]")
        form.locator("[data-testid=periodic-name]").fill("browser-entry")
        form.locator("[data-testid=periodic-task]").fill(proj_web.echo.name)
        form.locator("[data-testid=periodic-every]").fill("0.5")
        form.locator("button[data-action=periodic-set]").click()
        page.locator("#error", has_text="every").wait_for()
        assert [e["name"] for e in client.periodic() if e["source"] == "runtime"] == []
        # The refused entry's 400 is the one console error the page may have logged.
        assert [e for e in ui.errors if "400 (Bad Request)" not in e] == [], ui.errors
        ui.errors.clear()
        form.locator("[data-testid=periodic-every]").fill("3600")
        form.locator("button[data-action=periodic-set]").click()
        page.locator("[data-testid=periodic-result]", has_text="Created browser-entry.").wait_for()
        page.locator('tr[data-row="browser-entry"] .badge', has_text="runtime").wait_for()
        ui.shot("periodic")
        assert [e["name"] for e in client.periodic() if e["source"] == "runtime"] == [
            "browser-entry"]
        client.remove_periodic("browser-entry")
        ui.assert_clean()

        # The widget shows a unique job's lock while it waits in the scheduled set.
        waiting = proj_web.locked.apply_async(("widget-lock",), countdown=300)
        page = ui.open(f"/demo?job={waiting.id}")
        page.locator("[data-unique-lock]", has_text="held by this job").wait_for()
        assert "until_finished" in page.locator("[data-unique-lock]").inner_text()
        ui.assert_clean()

        # The job observer widget follows a job to the end.
        job = proj_web.progress.delay(8, 0.4)
        page = ui.open(f"/demo?job={job.id}")
        page.locator('[data-job-state="running"]').wait_for(timeout=15_000)
        page.wait_for_function(
            "document.querySelector('[data-celery-ext-job]').innerText.includes('step')")
        ui.shot("widget-running")
        page.locator('[data-job-state="succeeded"]').wait_for(timeout=20_000)
        ui.shot("widget-done")
        assert "'steps': 8" in page.locator("[data-celery-ext-job]").inner_text()
        ui.assert_clean()
        ui.context.close()
        assert {p.name for p in shots.iterdir()} >= {
            "overview.png", "queues.png", "pools.png", "busy.png", "scheduled.png",
            "retry.png", "dead.png", "dead-job.png", "revoked.png", "periodic.png",
            "widget-done.png"}
    finally:
        stop_all([web])
