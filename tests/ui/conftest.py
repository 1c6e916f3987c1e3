"""The dashboard against a real platform (the async regime's: API with the pools
controller, an `ember engine` replica, Redis, two `ember worker` processes), driven by
Debian's chromium through Python playwright."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.batch.conftest import BatchPlatform
from tests.jobs.conftest import live_platform

MODEL = "slow"
DELAY_S = 0.05
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


@pytest.fixture(scope="package")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatchPlatform]:
    """API + one replica of `slow` (max_batch_size 4) + two workers + Redis."""
    tmp = tmp_path_factory.mktemp("ui")
    with live_platform(BatchPlatform, tmp, MODEL, DELAY_S, max_batch_size=4) as platform:
        yield platform


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        pytest.fail("chromium is not installed: run `make test` (it installs Debian's chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()
