"""The dashboard in a real browser against a real platform: sign in (a wrong key refused
with a message), the deployment with its hot replica, load that moves the demand plot and
the replica count, the Jobs, Batch and Models pages, a tenant key refused another tenant's
page and data, screenshots that show something, every request to the API's origin, the
page under a strict Content-Security-Policy with no violation."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest

from ember.api.app import create_app
from ember.config import Settings
from tests import services
from tests.api.conftest import ADMIN_KEY
from tests.batch.conftest import BatchPlatform as Platform
from tests.batch.conftest import write_jsonl
from tests.ui import png
from tests.ui.conftest import MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

VIEWPORT = {"width": 1280, "height": 900}


class Page:
    """A browser tab on the dashboard that records every request it makes and every
    console error (a CSP violation is one)."""

    def __init__(self, browser: Any, url: str) -> None:
        self.context = browser.new_context(viewport=VIEWPORT, timezone_id="UTC")
        self.page = self.context.new_page()
        self.page.set_default_timeout(20_000)
        self.url = url
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def sign_in(self, key: str) -> None:
        self.page.goto(f"{self.url}/ui")
        self.page.wait_for_selector("#signin-form", state="visible")
        self.page.fill("#key", key)
        self.page.click("#signin-form button[type=submit]")

    def text(self, selector: str) -> str:
        return str(self.page.locator(selector).first.inner_text())

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def tab(browser: Any, platform: Platform) -> Iterator[Page]:
    page = Page(browser, platform.live.url)
    try:
        yield page
    finally:
        page.close()


def not_blank(shot: bytes, min_colours: int = 8) -> np.ndarray:
    image = png.decode(shot)
    assert image.shape[0] > 50 and image.shape[1] > 50, image.shape
    assert float(image[..., :3].std()) > 5.0, "the screenshot is (nearly) one colour"
    assert png.colours(image) >= min_colours, png.colours(image)
    return image


def same_origin(page: Page) -> None:
    origin = urlsplit(page.url)
    assert page.requests, "the page made no request"
    strays = [u for u in page.requests if urlsplit(u)[:2] != origin[:2]]
    assert not strays, f"requests that left the API's origin: {strays}"


def until(check: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    """Poll from here: the page's CSP (no eval) refuses playwright's wait_for_function."""
    services.wait_until(check, timeout_s, what)


def attr(page: Any, selector: str, name: str) -> str | None:
    value = page.locator(selector).first.get_attribute(name)
    return None if value is None else str(value)


class Load:
    """Predictions sent in a loop from a few threads until stopped."""

    def __init__(self, url: str, threads: int = 4) -> None:
        self.url = url
        self.stop = threading.Event()
        self.sent = 0
        self.threads = [threading.Thread(target=self._run) for _ in range(threads)]

    def _run(self) -> None:
        with httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
        ) as client:
            while not self.stop.is_set():
                client.post(f"/v1/models/{MODEL}:predict", json={"instances": [[0.5] * 256] * 2})
                self.sent += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def test_sign_in_refuses_a_wrong_key(tab: Page) -> None:
    tab.sign_in("ek_not-a-key")
    until(lambda: bool(tab.text("#signin-error")), "the sign-in message")
    assert "refused" in tab.text("#signin-error")
    assert tab.page.locator("#nav").is_hidden()
    same_origin(tab)
    assert not tab.errors or all("401" in e for e in tab.errors), tab.errors


def test_deployment_live(tab: Page, platform: Platform, tmp_path: Path) -> None:
    tab.sign_in(ADMIN_KEY)
    page = tab.page
    page.wait_for_selector(f"#deployments tr[data-row='{MODEL}']")
    row = page.locator(f"#deployments tr[data-row='{MODEL}'] td")
    assert row.nth(1).inner_text() == MODEL  # model
    assert row.nth(4).inner_text() == "1"  # one hot replica
    listing = page.screenshot(full_page=True)
    not_blank(listing)
    (tmp_path / "deployments.png").write_bytes(listing)

    page.click(f"#deployments a.deployment-link >> text={MODEL}")
    page.wait_for_selector("#replicas-now")
    hot = "#replicas-now [data-tier=hot] b"
    until(lambda: tab.text(hot) == "1", "one hot replica")
    page.wait_for_selector("#versions tr[data-row='1']")
    page.wait_for_selector("#plot-tiers canvas")
    page.wait_for_selector("#plot-demand canvas")
    until(lambda: int(attr(page, "#plot-tiers", "data-points") or 0) >= 2, "two samples")
    before = page.locator("#plot-demand").screenshot()

    # Room for a second replica; load the autoscaler sizes for (an uncalibrated replica
    # counts on a batch per second: 4 units/s).
    patched = platform.client.patch(f"/v1/deployments/{MODEL}", json={"max_replicas": 2})
    assert patched.status_code == 200, patched.text
    with Load(platform.live.url) as load:
        until(lambda: float(attr(page, "#plot-demand", "data-peak") or 0) > 1, "demand", 60)
        until(lambda: tab.text(hot) == "2", "a second hot replica", 120)
        assert load.sent > 0
    # the tiers plot saw a second replica (hot, or on its way first)
    until(lambda: '"hot":2' in (attr(page, "#plot-tiers", "data-last") or ""), "tiers plot", 30)
    after = page.locator("#plot-demand").screenshot()
    b, a = png.decode(before), png.decode(after)
    assert b.shape != a.shape or int(np.abs(b.astype(int) - a.astype(int)).sum()) > 0
    not_blank(after)
    not_blank(page.locator("#plot-tiers").screenshot())
    # the autoscaler's reasons and decisions, the versions' serving figures
    assert page.locator("#reasons li").count() > 0
    assert int(page.locator("#decisions").get_attribute("data-rows") or 0) > 0
    version_row = page.locator("#versions tr[data-row='1'] td")
    assert int(version_row.nth(4).inner_text().replace(",", "")) > 0  # answers in 5 min
    assert version_row.nth(5).inner_text() != "\u2014"  # a p50
    assert int(page.locator("#coldstarts").get_attribute("data-rows") or 0) >= 1
    shot = page.screenshot(full_page=True)
    not_blank(shot, min_colours=32)
    (tmp_path / "deployment.png").write_bytes(shot)

    # sortable: the replicas table sorts by replica id both ways
    page.click("#replicas th[data-key=replica_id]")
    first = page.locator("#replicas tbody tr").first.get_attribute("data-row")
    page.click("#replicas th[data-key=replica_id]")
    assert page.locator("#replicas tbody tr").first.get_attribute("data-row") != first
    same_origin(tab)
    assert not tab.errors, tab.errors


def test_jobs_batch_models(tab: Page, platform: Platform, tmp_path: Path) -> None:
    submitted = platform.submit([[0.5] * 256] * 2, priority=7)
    assert submitted.status_code in (200, 201, 202), submitted.text
    job_id = submitted.json()["id"]
    tab.sign_in(ADMIN_KEY)
    page = tab.page
    page.wait_for_selector("#deployments")
    page.click("#nav a[data-page=jobs]")
    page.wait_for_selector(f"#jobs tr[data-row='{job_id}']")
    platform.wait(job_id)
    until(lambda: "succeeded" in tab.text(f"#jobs tr[data-row='{job_id}']"), "succeeded", 30)
    assert page.locator("#queue").count() == 1
    jobs_shot = page.screenshot(full_page=True)
    not_blank(jobs_shot)

    rows = [{"id": i, "features": [0.5] * 256} for i in range(40)]
    uri = write_jsonl(platform.root / "ui" / "rows.jsonl", rows)
    started = platform.run(
        spec={"model": MODEL, "input_uri": uri, "output_uri": (platform.root / "ui-out").as_uri(),
              "shard_rows": 10},
    )  # fmt: skip
    assert started.status_code == 202, started.text
    run_id = started.json()["id"]
    schedule = platform.client.post(
        "/v1/batch/schedules",
        json={"name": "yearly", "model": MODEL, "input_uri": uri, "cron": "0 3 1 1 *",
              "output_uri": (platform.root / "ui-yearly").as_uri()},
    )  # fmt: skip
    assert schedule.status_code == 201, schedule.text
    assert schedule.json()["next_fire_at"]
    page.click("#nav a[data-page=batch]")
    page.wait_for_selector("#schedules")
    page.wait_for_selector(f"#runs tr[data-row='{run_id}']")
    assert platform.wait_run(run_id)["status"] == "succeeded"
    run_row = f"#runs tr[data-row='{run_id}']"
    until(lambda: "succeeded" in tab.text(run_row), "the run succeeded on the page", 30)
    assert "40 / 40 rows" in tab.text(run_row)
    assert page.locator(f"{run_row} progress").get_attribute("value") == "40"
    next_fire = page.locator("#schedules tr[data-row='yearly'] td").nth(4).inner_text()
    year = schedule.json()["next_fire_at"][:4]  # the next 1 January, 03:00 UTC
    assert next_fire != "\u2014" and year in next_fire, (next_fire, year)

    # hostile text from a tenant is shown as text, never run as markup
    hostile = '<img src=x onerror="window.__pwned=1"><b>bold</b>'
    made = platform.client.post("/v1/models", json={"name": "hostile", "description": hostile})
    assert made.status_code == 201, made.text
    platform.live.register("hostile", "1")

    page.click("#nav a[data-page=models]")
    page.wait_for_selector(f"#models tr[data-row='{MODEL}:1']")
    assert "hot replica" in page.locator(f"#models tr[data-row='{MODEL}:1']").inner_text()
    (tmp_path / "jobs.png").write_bytes(jobs_shot)
    page.wait_for_selector("#models tr[data-row='hostile:1']")
    assert hostile in tab.text("#models tr[data-row='hostile:1']")
    assert page.locator("#models img, #models b").count() == 0
    assert page.evaluate("() => window.__pwned === undefined")
    page.click(f"#models tr[data-row='{MODEL}:1'] a")
    page.wait_for_selector("#files tbody tr[data-row]")
    version = platform.client.get(f"/v1/models/{MODEL}/versions/1").json()
    assert version["sha256"] in page.locator("#files").inner_text()
    models_shot = page.screenshot(full_page=True)
    not_blank(models_shot)
    (tmp_path / "models.png").write_bytes(models_shot)
    page.click("#nav a[data-page=batch]")
    page.wait_for_selector(run_row)
    (tmp_path / "batch.png").write_bytes(page.screenshot(full_page=True))

    # signing out forgets the key and what the page showed
    page.click("#signout")
    page.wait_for_selector("#signin", state="visible")
    assert page.locator("#view > *").count() == 0
    assert page.evaluate("() => sessionStorage.getItem('ember.key')") is None
    page.reload()
    page.wait_for_selector("#signin", state="visible")
    same_origin(tab)
    assert not tab.errors, tab.errors


def test_a_tenant_sees_only_its_own(tab: Page, platform: Platform, browser: Any) -> None:
    client = platform.client
    created = client.post("/v1/tenants", json={"name": "ui-other"})
    assert created.status_code == 201, created.text
    minted = client.post("/v1/keys", json={"name": "ui", "tenant": "ui-other"})
    assert minted.status_code == 201, minted.text
    key = minted.json()["key"]
    tab.sign_in(key)
    page = tab.page
    page.wait_for_selector("#deployments")
    assert page.locator("#deployments").get_attribute("data-rows") == "0"
    assert "ui-other" in tab.text("#who")
    page.goto(f"{platform.live.url}/ui#/deployments/{MODEL}")
    page.wait_for_selector("#error:not([hidden])")
    assert "Not found" in tab.text("#error")
    assert page.locator("#replicas-now").count() == 0
    # nor its data, asked for from the page with the tenant's key
    for path in ("history", "answers", "replicas", "autoscaler"):
        status = page.evaluate(
            "async ([path, key]) =>"
            " (await fetch(path, {headers: {Authorization: `Bearer ${key}`}})).status",
            [f"/v1/deployments/{MODEL}/{path}", key],
        )
        assert status == 404, (path, status)
    jobs = httpx.get(
        f"{platform.live.url}/v1/dashboard/jobs", headers={"Authorization": f"Bearer {key}"}
    )
    assert jobs.status_code == 200 and jobs.json() == {"queue": [], "recent": []}
    not_blank(page.screenshot(full_page=True), min_colours=4)
    same_origin(tab)

    # an admin sees every tenant's: it picks the tenant to act for (X-Ember-Tenant)
    admin = Page(browser, platform.live.url)
    try:
        admin.sign_in(ADMIN_KEY)
        admin.page.wait_for_selector(f"#deployments tr[data-row='{MODEL}']")
        admin.page.select_option("#tenant", "ui-other")
        until(lambda: attr(admin.page, "#deployments", "data-rows") == "0", "the other tenant")
        admin.page.select_option("#tenant", "default")
        admin.page.wait_for_selector(f"#deployments tr[data-row='{MODEL}']")
        same_origin(admin)
        assert not admin.errors, admin.errors
    finally:
        admin.close()


def test_another_api_process_shows_the_leaders_history(platform: Platform) -> None:
    """An API process without a pools controller reads the samples the acting controller
    wrote to Redis."""
    settings = Settings(
        data_dir=platform.settings.data_dir,
        admin_key=ADMIN_KEY,  # type: ignore[arg-type]
        redis_url=platform.settings.redis_url,
        pools_enabled=False,
    )
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    path = f"/v1/deployments/{MODEL}/history"
    with services.serve_app(create_app(settings)) as url:
        services.wait_until(
            lambda: bool(platform.client.get(path).json()["samples"]), 30, "history samples"
        )
        ours = httpx.get(url + path, headers=headers)
        theirs = platform.client.get(path)
    assert ours.status_code == 200, ours.text
    mine = ours.json()["samples"]
    assert mine
    newest = mine[-1]["t"]
    assert [s for s in theirs.json()["samples"] if s["t"] <= newest] == mine


def test_ui_headers(platform: Platform) -> None:
    for path in ("/ui", "/ui/static/app.js", "/ui/static/vendor/uplot/uPlot.iife.min.js"):
        response = httpx.get(platform.live.url + path)
        assert response.status_code == 200, path
        csp = response.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp
        assert response.headers["x-content-type-options"] == "nosniff"
    missing = httpx.get(platform.live.url + "/ui/static/../../api/app.py")
    assert missing.status_code == 404
    assert missing.headers["content-type"].startswith("application/problem+json")
    # the JSON needs a key like every control-plane route
    anonymous = httpx.get(f"{platform.live.url}/v1/deployments/{MODEL}/history")
    assert anonymous.status_code == 401
    bad = platform.client.get(f"/v1/deployments/{MODEL}/history", params={"since": "soon"})
    assert bad.status_code == 422
    services.wait_until(
        lambda: bool(platform.client.get(f"/v1/deployments/{MODEL}/history").json()["samples"]),
        30,
        "history samples",
    )
    samples = platform.client.get(f"/v1/deployments/{MODEL}/history").json()["samples"]
    since = samples[-1]["t"]
    later = platform.client.get(f"/v1/deployments/{MODEL}/history", params={"since": since})
    assert all(s["t"] > since for s in later.json()["samples"])


def test_page_code_puts_no_markup_from_data() -> None:
    """Every string from the API goes in as text: the page's code has no HTML sinks."""
    from importlib import resources

    code = (resources.files("ember.api.ui") / "static" / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in code, sink
