"""A headless Chromium for the dashboard's browser tests (Debian's ``chromium``, driven by
Playwright): the module-scoped ``browser`` fixture (import it into the test module) and
:class:`Page`, which records script errors and takes named screenshots."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.debian import ensure_installed

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def _ensure_chromium() -> str:
    """Debian's chromium, installed with apt-get when missing; skip if impossible."""
    try:
        return ensure_installed("chromium", CHROMIUM)
    except LookupError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    executable = _ensure_chromium()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


class Page:
    """A browser page that records script errors and takes named screenshots."""

    def __init__(self, browser: Any, base: str, shots: Path) -> None:
        self.base = base
        self.shots = shots
        self.errors: list[str] = []
        # Without the dashboard's Content-Security-Policy: escaping alone must keep job
        # data from running script (CSP is the second line of defence, tested elsewhere).
        self.context = browser.new_context(viewport={"width": 1280, "height": 800},
                                           bypass_csp=True)
        self.page = self.context.new_page()
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on("console", lambda msg: self.errors.append(msg.text)
                     if msg.type == "error" else None)
        self.page.on("dialog", lambda dialog: dialog.accept())

    def open(self, path: str, shot: str | None = None) -> Any:
        self.page.goto(self.base + path)
        if path.startswith("/dead/") or path.startswith("/demo"):
            self.page.wait_for_load_state("load")
        else:
            self.page.wait_for_function("Number(document.body.dataset.loaded || 0) >= 1")
        if shot:
            self.shot(shot)
        return self.page

    def refreshed(self) -> None:
        """Wait for the next self-refresh of the page."""
        n = self.page.evaluate("Number(document.body.dataset.loaded || 0)")
        self.page.wait_for_function(f"Number(document.body.dataset.loaded || 0) > {n}")

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(self.shots / f"{name}.png"), full_page=True)

    def assert_clean(self) -> None:
        assert self.page.evaluate("typeof window.__pwned") == "undefined", "job data ran script"
        assert self.page.locator("img").count() == 0, "job data became markup"
        assert not self.errors, self.errors
