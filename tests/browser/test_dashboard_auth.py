"""The dashboard with ``RLRUN_AUTH=on`` in headless Chromium: a 401 brings up the API key form, a wrong key
shows the API's message and asks again, the right key (made with `rlrun keys create`, as a user does) opens
the pages and feeds the live view through the fetch()-based event stream, and "forget key" asks again.
The stream reader's parsing and reconnection are checked in the page against a scripted ``fetch``.

Same browser and helpers as test_dashboard.py (skipped without Debian's chromium and chromium-driver).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from rlrun.demo import addition_pairs
from tests.browser import test_dashboard as dashboard
from tests.browser.test_dashboard import open_page, points, screenshot, submit_dpo, text, wait, wait_run
from tests.factories import jsonl
from tests.integration.flow import FINISHED, create_key, embedded_server

# test_dashboard's fixtures: the Chromium (this module gets its own), the auth-off server, the screenshots
browser = dashboard.browser
served = dashboard.served
artifacts = dashboard.artifacts

pytestmark = pytest.mark.slow

KEY_ITEM = "rlrun.apiKey"  # app.js: the sessionStorage item
WRONG_KEY = "rlrun_00000000_not-a-key-of-this-server"
SHORT_STEPS = 20


@dataclass(frozen=True)
class Secured:
    client: httpx.Client  # sends the key
    key: str
    short: str  # a finished DPO run (it has checkpoints)
    long: str  # a DPO run that trains until the live-view test cancels it


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    home = tmp_path_factory.mktemp("browser-auth")
    with embedded_server(home, env={"RLRUN_AUTH": "on"}) as client:
        key = create_key(home, "dashboard")
        assert client.get("/v1/runs").status_code == 401
        client.headers["Authorization"] = f"Bearer {key}"
        resp = client.post(
            "/v1/datasets",
            files={"file": ("pairs.jsonl", jsonl(addition_pairs(64)))},
            data={"kind": "preference", "name": "addition-pairs"},
        )
        assert resp.status_code == 201, resp.text
        short = submit_dpo(client, resp.json()["id"], "dpo-short", SHORT_STEPS)
        long = submit_dpo(client, resp.json()["id"], "dpo-long", 20_000, log_every=1)  # runs after short
        try:
            assert wait_run(client, short, lambda r: r["status"] in FINISHED)["status"] == "succeeded"
            yield Secured(client, key, short, long)
        finally:
            if client.get(f"/v1/runs/{long}").json()["status"] not in FINISHED:
                client.post(f"/v1/runs/{long}/cancel")
                wait_run(client, long, lambda r: r["status"] in FINISHED, timeout=30)


# ---------- helpers ----------


def shown(browser: WebDriver, testid: str) -> bool:
    """Whether the element is there and not hidden (the [hidden] attribute on it)."""
    found: bool = browser.execute_script(
        "const el = document.querySelector(`[data-testid='${CSS.escape(arguments[0])}']`);"
        "return Boolean(el && !el.hidden);",
        testid,
    )
    return found


def stored_key(browser: WebDriver) -> Any:
    return browser.execute_script(f"return sessionStorage.getItem('{KEY_ITEM}')")


def enter_key(browser: WebDriver, key: str) -> None:
    wait(browser, lambda: shown(browser, "key-form"), what="no key form")
    field = browser.find_element(By.CSS_SELECTOR, '[data-testid="key-input"]')
    assert field.get_attribute("type") == "password"
    field.clear()
    field.send_keys(key)
    browser.find_element(By.CSS_SELECTOR, '[data-testid="key-submit"]').click()


def run_row(browser: WebDriver, run_id: str) -> bool:
    return bool(browser.find_elements(By.CSS_SELECTOR, f'[data-testid="run-row"][data-run-id="{run_id}"]'))


def assert_key_kept_private(browser: WebDriver, key: str) -> None:
    """The key is in this tab's sessionStorage only, and in no URL the page requested."""
    assert stored_key(browser) == key
    assert browser.execute_script("return localStorage.length") == 0
    assert browser.execute_script("return document.cookie") == ""
    urls: list[str] = browser.execute_script(
        "return [location.href, ...performance.getEntriesByType('resource').map((e) => e.name)]"
    )
    assert any("/v1/runs" in u for u in urls), urls
    assert not [u for u in urls if key in u or "rlrun_" in u], urls


def assert_no_console_errors_but_401s(browser: WebDriver) -> None:
    """Chromium logs each 401 answer ("Failed to load resource"); those are expected here."""
    logs = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not [m for m in logs if "status of 401" not in m], logs


# ---------- tests ----------


def test_no_key_form_with_auth_off(served: httpx.Client, browser: WebDriver) -> None:
    open_page(browser, served, "/runs")
    wait(browser, lambda: shown(browser, "runs-table"), what="no runs table")
    wait(browser, lambda: "No runs yet" in text(browser, "runs-table"), what="runs not loaded")
    assert not shown(browser, "key-form")
    assert not shown(browser, "key-status")
    assert stored_key(browser) is None
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_key_form_asks_for_a_key_and_refuses_a_wrong_one(
    secured: Secured, browser: WebDriver, artifacts: Path
) -> None:
    open_page(browser, secured.client, "/runs")
    wait(browser, lambda: shown(browser, "key-form"), what="no key form on a 401")
    assert "rlrun keys create --project NAME" in text(browser, "key-form")
    assert not shown(browser, "key-error")  # no key was sent: nothing was refused yet
    assert not shown(browser, "runs-table")
    assert not shown(browser, "error-banner")  # the form says it

    enter_key(browser, WRONG_KEY)
    wait(browser, lambda: shown(browser, "key-error"), what="wrong key not refused")
    assert text(browser, "key-error") == "invalid or revoked API key"  # the API's message
    assert shown(browser, "key-form")
    assert not shown(browser, "runs-table")
    assert not shown(browser, "key-status")
    assert stored_key(browser) is None
    screenshot(browser, artifacts, "key-form")


def test_right_key_opens_the_runs_table(secured: Secured, browser: WebDriver, artifacts: Path) -> None:
    open_page(browser, secured.client, "/runs")
    enter_key(browser, secured.key)
    wait(browser, lambda: run_row(browser, secured.long), what="runs table without the run")
    assert run_row(browser, secured.short)
    assert not shown(browser, "key-form")
    prefix = "_".join(secured.key.split("_")[:2])  # the key's public part (`rlrun keys list`)
    assert text(browser, "key-status").split() == ["key", prefix, "forget", "key"]
    assert_key_kept_private(browser, secured.key)
    screenshot(browser, artifacts, "runs-with-key")
    assert_no_console_errors_but_401s(browser)


def test_checkpoint_download_sends_the_key(secured: Secured, browser: WebDriver, tmp_path: Path) -> None:
    browser.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path)})
    open_page(browser, secured.client, f"/runs/{secured.short}")
    link = '[data-testid="checkpoint-download"]'
    wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, link), what="no checkpoint")
    browser.find_elements(By.CSS_SELECTOR, link)[-1].click()
    wait(browser, lambda: [p for p in tmp_path.glob("*.tar") if p.stat().st_size], what="nothing downloaded")
    (tar,) = tmp_path.glob("*.tar")
    time.sleep(0.3)  # the file is written in one go from a blob, but let it settle
    assert tar.read_bytes()[257:262] == b"ustar", tar.read_bytes()[:200]  # a tar, not a JSON error
    assert not shown(browser, "key-form")


def test_live_view_streams_with_the_key(secured: Secured, browser: WebDriver) -> None:
    run_id = secured.long
    wait_run(secured.client, run_id, lambda r: r["status"] == "running" and r["progress"]["step"] > 0)
    open_page(browser, secured.client, f"/runs/{run_id}")
    wait(browser, lambda: points(browser, "chart-loss", "loss") > 0, what="no loss chart")
    wait(browser, lambda: text(browser, "live") == "● live", what="stream not connected")
    before = points(browser, "chart-loss", "loss")
    # only the stream adds points to a chart (the page reloads the run, never its metrics)
    wait(browser, lambda: points(browser, "chart-loss", "loss") >= before + 5, what="no streamed points")
    assert not shown(browser, "key-form")

    assert secured.client.post(f"/v1/runs/{run_id}/cancel").status_code == 200
    wait(browser, lambda: text(browser, "status") == "cancelled", timeout=20, what="status not streamed")
    wait(browser, lambda: not text(browser, "live"), what="stream not ended")
    assert "cancelled" in text(browser, "events")
    assert_key_kept_private(browser, secured.key)
    assert_no_console_errors_but_401s(browser)


def test_forget_key_brings_the_form_back(secured: Secured, browser: WebDriver) -> None:
    open_page(browser, secured.client, "/runs")
    wait(browser, lambda: run_row(browser, secured.short), what="runs table without the run")
    browser.find_element(By.CSS_SELECTOR, '[data-testid="forget-key"]').click()
    wait(browser, lambda: shown(browser, "key-form"), what="no key form after forget key")
    assert stored_key(browser) is None
    assert not shown(browser, "key-error")
    assert not shown(browser, "key-status")
    assert not shown(browser, "runs-table")
    browser.refresh()  # the key is gone for good, not only from the page's memory
    wait(browser, lambda: shown(browser, "key-form"), what="no key form after a reload")


# The event-stream reader, against a scripted fetch(): two connections, the first dropped mid-message.
STREAM_SCRIPT = r"""
const done = arguments[arguments.length - 1];
const bytes = (s) => new TextEncoder().encode(s);
const cafe = bytes("event: name\ndata: caf\u00e9\n\n");
const bodies = [
  [bytes("retry: 50\n"),                                  // reconnect quickly
   bytes("id: 1\nevent: metrics\ndata: [1,\ndata:2]\n\n"), // two data lines; "data:" without a space
   bytes(": keep-alive\n\n"),                              // a comment: nothing dispatched
   bytes("id: 2\r"), bytes("\nevent: status\r\ndata: a\r\r"), // CRLF split over two reads; CR alone
   bytes("id: 3\nevent: metrics\ndata: lost")],            // dropped before its blank line
  [cafe.slice(0, -3), cafe.slice(-3),                      // a UTF-8 character split over two reads
   bytes("data: plain\n\n"),                               // no event: type "message"
   bytes("event: end\ndata: {}\n\nevent: status\ndata: after end\n\n")],
];
const requests = [];
const seen = [];
const states = [];
const realFetch = window.fetch;
window.fetch = async (url, init) => {
  requests.push({ url, lastEventId: init.headers["Last-Event-ID"] || null,
    authorization: init.headers.Authorization || null });
  const chunks = bodies[requests.length - 1] || [];
  const body = new ReadableStream({ start(c) { chunks.forEach((b) => c.enqueue(b)); c.close(); } });
  return new Response(body, { headers: { "Content-Type": "text/event-stream; charset=utf-8" } });
};
sessionStorage.setItem("rlrun.apiKey", "rlrun_test_key");
const es = new FetchEventSource("/v1/runs/x/stream");
es.onopen = () => states.push("open");
es.onerror = () => states.push(es.readyState === FetchEventSource.CLOSED ? "closed" : "reconnecting");
for (const type of ["metrics", "status", "name", "message"]) {
  es.addEventListener(type, (m) => seen.push([m.type, m.data, m.lastEventId]));
}
es.addEventListener("end", (m) => {
  seen.push([m.type, m.data, m.lastEventId]);
  es.close();
  setTimeout(() => {  // long enough for a reconnection that should not happen
    window.fetch = realFetch;
    sessionStorage.removeItem("rlrun.apiKey");
    done({ requests, seen, states, readyState: es.readyState });
  }, 300);
});
"""


def test_stream_reader_parses_like_eventsource_and_resumes(secured: Secured, browser: WebDriver) -> None:
    open_page(browser, secured.client, "/nowhere")  # a page that makes no API call
    wait(browser, lambda: "No such page" in text(browser, "app"), what="page not loaded")
    browser.set_script_timeout(10)
    out = browser.execute_async_script(STREAM_SCRIPT)
    assert out["seen"] == [
        ["metrics", "[1,\n2]", "1"],
        ["status", "a", "2"],
        ["name", "café", "2"],
        ["message", "plain", "2"],
        ["end", "{}", "2"],
    ]
    auth = "Bearer rlrun_test_key"
    assert out["requests"] == [
        {"url": "/v1/runs/x/stream", "lastEventId": None, "authorization": auth},
        {"url": "/v1/runs/x/stream", "lastEventId": "2", "authorization": auth},  # resumed, not from 3
    ]
    assert out["states"] == ["open", "reconnecting", "open"]
    assert out["readyState"] == 2  # CLOSED, by the "end" handler
