"""The live dashboard at ``/ui`` in headless Chromium (Debian's ``chromium``, driven by Playwright), over real HTTP
on the shipped model with API keys: a running job's threads appear as they decode, then its vote, answer and each
thread's compression; the KV chart fills; the controller's plan shows; another key sees none of it. The
screenshot of the running job is kept (``THINKPOOL_DASHBOARD_PNG=path`` also writes it there, as docs/ shows it)."""

import os
import shutil

import httpx
import pytest

from dms_runtime.loading import SHIPPED_MODEL
from http_server import serving
from orchestrator.api import create_app
from orchestrator.jobs import MemoryJobStore
from orchestrator.service import service_factory

ALICE, BOB = "alice-key", "bob-key"
HARD = "a=76;b=53;c=28;d=18;e=d*b;f=e+a;g=f*c;h=g-d;i=h*h;j=i+e;?j"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def server():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("THINKPOOL_API_KEYS", f"{ALICE},{BOB}")
        app = create_app(service_factory(SHIPPED_MODEL, 20_000_000, 0), store=MemoryJobStore())
    with serving(app, ready_s=60) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    assert os.path.exists(chromium), "Debian's chromium is not installed: run scripts/test.sh (it installs it)"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        yield launched
        launched.close()


def submit(url: str, key: str, body: dict) -> str:
    response = httpx.post(f"{url}/v1/solve", json={**body, "async": True}, headers={"X-API-Key": key}, timeout=60)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def open_dashboard(browser, url: str, key: str, job_id: str | None = None):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{url}/ui")
    page.fill("#key", key)
    page.dispatch_event("#key", "change")
    if job_id:
        page.evaluate("id => { location.hash = 'job=' + id }", job_id)
    return page


def test_a_running_job_shows_its_threads_as_they_decode_then_its_vote(server, browser, tmp_path):
    job_id = submit(server, ALICE, {"prompt": HARD, "samples": 8, "max_tokens": 1500, "temperature": 1.0})
    page = open_dashboard(browser, server, ALICE, job_id)
    page.wait_for_selector(f"#jobs tr[data-job='{job_id}']", timeout=30_000)
    # Threads decoding: rows with tokens counted before they finish (tokens flow from the engine while they run).
    page.wait_for_function("""() => [...document.querySelectorAll('.thread-row.decoding')]
                                    .some(row => Number(row.dataset.tokens) > 120)
                                 && Number(document.querySelector('#kv').dataset.samples) >= 3""", timeout=120_000)
    assert page.text_content("#job-state") == "running"
    shot = page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    assert len(shot) > 10_000
    if os.environ.get("THINKPOOL_DASHBOARD_PNG"):
        shutil.copy(tmp_path / "dashboard.png", os.environ["THINKPOOL_DASHBOARD_PNG"])
    page.wait_for_function("() => document.querySelector('#job-state').textContent === 'done'", timeout=600_000)
    page.wait_for_function("() => document.querySelectorAll('.thread-row.finished').length === 8", timeout=30_000)
    result = httpx.get(f"{server}/v1/jobs/{job_id}", headers={"X-API-Key": ALICE}).json()["result"]
    assert page.inner_text("#answer") == f"answer: {result['answer']}"
    shown = {row.get_attribute("data-answer") for row in page.query_selector_all(".vote-row")}
    assert shown == {t["answer"] for t in result["threads"] if t["answer"] is not None}  # the vote, as it formed
    ratios = [cell.inner_text() for cell in page.query_selector_all(".thread-row td:nth-child(4)")]
    assert len(ratios) == 8 and all(r.endswith("x") for r in ratios)  # each thread's realized compression
    page.wait_for_function("() => Number(document.querySelector('#kv').dataset.samples) >= 3", timeout=30_000)
    assert "peak" in page.inner_text("#kv-now")
    page.close()


def test_the_controllers_plan_shows_and_another_key_sees_no_job(server, browser):
    job_id = submit(server, ALICE, {"prompt": HARD, "samples": "auto", "mode": "controller", "max_threads": 8})
    page = open_dashboard(browser, server, ALICE, job_id)
    page.wait_for_selector("#events li.event-plan", timeout=120_000)
    assert "thread" in page.inner_text("#events li.event-plan")
    page.close()
    other = open_dashboard(browser, server, BOB)
    other.wait_for_selector("#no-jobs:not([hidden])", timeout=30_000)
    assert other.query_selector_all("#jobs tr") == []
    other.close()


def test_the_page_needs_no_key_but_its_data_does(server):
    assert httpx.get(f"{server}/ui").status_code == 200
    assert httpx.get(f"{server}/v1/jobs").status_code == 401
    assert httpx.get(f"{server}/v1/pool").status_code == 401
    pool = httpx.get(f"{server}/v1/pool", headers={"X-API-Key": BOB}).json()
    assert pool["pool_bytes"] > 0 and 0 <= pool["pool_used_bytes"] <= pool["pool_bytes"] and pool["workers"]
