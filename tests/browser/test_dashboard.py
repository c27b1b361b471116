"""The web dashboard (api/static/) in a real browser: headless Chromium driven by Selenium against
`rlrun serve` on the embedded defaults (SQLite + kombu SQL broker), with data made through the HTTP API.

Needs Debian's ``chromium`` and ``chromium-driver`` (/usr/bin/chromium, /usr/bin/chromedriver); without
them the module is skipped, or fails when CI=true. Selenium Manager is never used (nothing is downloaded).
Screenshots go to a temporary folder, and are copied to $RLRUN_TEST_ARTIFACTS when it is set.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlrun.demo import addition_pairs
from tests.factories import jsonl
from tests.integration.flow import FINISHED, embedded_server

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL_HINT = "install them with: apt-get install chromium chromium-driver"
_missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
if _missing:
    _why = f"browser tests need {' and '.join(_missing)}; {INSTALL_HINT}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true: {_why}", pytrace=False)
    pytest.skip(_why, allow_module_level=True)

from selenium import webdriver  # noqa: E402  (only once the browser is known to be there)
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

SHORT_STEPS = 40
WIDTH = 1400


# ---------- server, data and browser ----------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with embedded_server(tmp_path_factory.mktemp("browser-serve"), inference=True) as client:
        yield client


def upload_pairs(client: httpx.Client, n: int, name: str = "pairs") -> str:
    """A preference dataset of ``n`` addition pairs, uploaded; its id."""
    resp = client.post(
        "/v1/datasets",
        files={"file": ("pairs.jsonl", jsonl(addition_pairs(n)))},
        data={"kind": "preference", "name": name},
    )
    assert resp.status_code == 201, resp.text
    dataset_id: str = resp.json()["id"]
    return dataset_id


def submit_dpo(client: httpx.Client, dataset_id: str, name: str, steps: int, **hp: Any) -> str:
    spec = {
        "algorithm": "dpo",
        "name": name,
        "model": "tiny:llama-0.4m",
        "dataset_id": dataset_id,
        "hyperparameters": {"learning_rate": 1e-3, "max_steps": steps, "batch_size": 8, **hp},
    }
    resp = client.post("/v1/runs", json=spec)
    assert resp.status_code == 201, resp.text
    run_id: str = resp.json()["id"]
    return run_id


def wait_run(
    client: httpx.Client, run_id: str, ok: Callable[[dict[str, Any]], bool], timeout: float = 90
) -> Any:
    deadline = time.monotonic() + timeout
    while not ok(run := client.get(f"/v1/runs/{run_id}").json()):
        assert time.monotonic() < deadline, run
        time.sleep(0.2)
    return run


@pytest.fixture(scope="module")
def data(served: httpx.Client) -> Iterator[dict[str, str]]:
    """A preference dataset, two finished DPO runs (different seeds) and a long run queued behind them."""
    ds = upload_pairs(served, 64, "addition-pairs")
    a = submit_dpo(served, ds, "dpo-seed0", SHORT_STEPS, seed=0)
    b = submit_dpo(served, ds, "dpo-seed1", SHORT_STEPS, seed=1)
    long = submit_dpo(served, ds, "dpo-long", 20_000, log_every=1)  # starts after a and b; cancelled
    try:
        for run_id in (a, b):
            assert wait_run(served, run_id, lambda r: r["status"] in FINISHED)["status"] == "succeeded"
        yield {"dataset": ds, "a": a, "b": b, "long": long}
    finally:
        if served.get(f"/v1/runs/{long}").json()["status"] not in FINISHED:
            served.post(f"/v1/runs/{long}/cancel")
            wait_run(served, long, lambda r: r["status"] in FINISHED, timeout=30)


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    profile = tempfile.mkdtemp(prefix="rlrun-chromium-")
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        f"--window-size={WIDTH},1000",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dashboard-screenshots")


# ---------- helpers ----------


def open_page(browser: WebDriver, client: httpx.Client, route: str) -> None:
    browser.get(f"{client.base_url}/#{route}")


def wait(browser: WebDriver, predicate: Callable[[], Any], timeout: float = 15, what: str = "") -> Any:
    return WebDriverWait(browser, timeout, poll_frequency=0.2).until(lambda _: predicate(), message=what)


def points(browser: WebDriver, chart: str, series: str) -> int:
    """How many points of one series the chart (figure data-chart=chart) holds: its legend item's data-points
    (-1: no such chart or series)."""
    n: int = browser.execute_script(
        "const fig = document.querySelector(`figure[data-chart='${CSS.escape(arguments[0])}']`);"
        "const item = fig && fig.querySelector(`.legend-item[data-series='${CSS.escape(arguments[1])}']`);"
        "return item && item.dataset.points ? Number(item.dataset.points) : -1;",
        chart,
        series,
    )
    return n


def click(browser: WebDriver, css: str) -> None:
    """Click an element, finding it again if the page re-rendered it meanwhile (the runs table refreshes)."""

    def attempt() -> bool:
        try:
            browser.find_element(By.CSS_SELECTOR, css).click()
            return True
        except (NoSuchElementException, StaleElementReferenceException):
            return False

    wait(browser, attempt, what=f"cannot click {css}")


def text(browser: WebDriver, testid: str) -> str:
    """The element's visible text, read in one script call: the live page re-renders elements while
    they update, so a found-then-read WebElement can go stale in between."""
    value: str = browser.execute_script(
        "const el = document.querySelector(`[data-testid='${CSS.escape(arguments[0])}']`);"
        "return el ? el.innerText.trim() : '';",
        testid,
    )
    return value


def screenshot(browser: WebDriver, folder: Path, name: str) -> Path:
    """A full-page PNG in ``folder``, copied to $RLRUN_TEST_ARTIFACTS when set; prints where."""
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(WIDTH, min(max(int(height), 800), 4000))
    time.sleep(0.3)  # charts re-render at the new width
    path = folder / f"{name}.png"
    assert browser.save_screenshot(str(path)), path
    browser.set_window_size(WIDTH, 1000)
    print(f"\nscreenshot: {path}")  # noqa: T201
    if target := os.environ.get("RLRUN_TEST_ARTIFACTS"):
        Path(target).mkdir(parents=True, exist_ok=True)
        copy = Path(shutil.copy(path, Path(target) / path.name))
        print(f"screenshot: {copy}")  # noqa: T201
    return path


def assert_no_console_errors(browser: WebDriver) -> None:
    errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


# ---------- tests ----------


def test_finished_run_page_shows_its_charts(
    served: httpx.Client, data: dict[str, str], browser: WebDriver, artifacts: Path
) -> None:
    open_page(browser, served, f"/runs/{data['a']}")
    wait(browser, lambda: points(browser, "chart-loss", "loss") > 1, what="no loss chart")
    assert points(browser, "chart-loss", "loss") == SHORT_STEPS  # every logged step (< max_points)
    assert points(browser, "chart-rewards/chosen", "rewards/rejected") == SHORT_STEPS  # grouped chart
    sections = browser.execute_script(  # [name, open, charts]: with more than 8 charts, 2 sections open
        "return [...document.querySelectorAll('[data-testid=chart-section]')]"
        "  .map((d) => [d.dataset.section, d.open, d.querySelectorAll('figure[data-chart]').length]);"
    )
    assert sections[0][0] == "Loss and reward" and sum(n for _, _, n in sections) > 8
    assert [is_open for _, is_open, _ in sections] == [True, True] + [False] * (len(sections) - 2)
    assert text(browser, "status") == "succeeded"
    assert f"{SHORT_STEPS} / {SHORT_STEPS}" in text(browser, "progress")
    assert "loss" in text(browser, "final-metrics")  # final/* values as a table, not charts
    assert browser.find_elements(By.CSS_SELECTOR, '[data-testid="checkpoint-download"]')
    algorithm = browser.find_element(By.CSS_SELECTOR, '[data-testid="spec"] tr[data-path="algorithm"]')
    assert algorithm.text.split() == ["algorithm", "dpo"]  # the spec as a table of dotted paths
    assert "succeeded" in text(browser, "events")
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="cancel-button"]')
    screenshot(browser, artifacts, "run-page")
    assert_no_console_errors(browser)


def test_playground_streams_the_run_and_its_start_side_by_side(
    served: httpx.Client, data: dict[str, str], browser: WebDriver, artifacts: Path
) -> None:
    run_id = data["a"]
    open_page(browser, served, f"/runs/{run_id}")
    wait(browser, lambda: text(browser, "playground") != "", what="no playground on a succeeded run")
    assert browser.find_element(By.ID, "pg-other").get_attribute("value") == "tiny:llama-0.4m"  # its start
    browser.find_element(By.ID, "pg-prompt").send_keys("12+30=")
    click(browser, '[data-testid="pg-ask"]')
    expected = [
        served.post(
            "/v1/completions", json={"model": model, "prompt": "12+30=", "max_tokens": 32, "temperature": 0}
        ).json()["choices"][0]["text"]
        for model in (f"run:{run_id}", "tiny:llama-0.4m")
    ]
    assert expected[0], "the DPO model answered nothing: the comparison below would be empty"
    for i, answer in enumerate(expected):  # streamed into the page, the same greedy text as asked directly
        wait(
            browser,
            lambda i=i, answer=answer: (
                browser.execute_script(
                    "return document.querySelector(`[data-testid='pg-answer-${arguments[0]}']`).textContent",
                    i,
                )
                == answer
            ),
            timeout=60,
            what=f"answer {i} is not the model's",
        )
    assert f"run:{run_id}" in text(browser, "playground") and "tiny:llama-0.4m" in text(browser, "playground")
    screenshot(browser, artifacts, "playground")
    assert_no_console_errors(browser)


def test_compare_two_runs_from_the_runs_table(
    served: httpx.Client, data: dict[str, str], browser: WebDriver, artifacts: Path
) -> None:
    open_page(browser, served, "/runs")
    for run_id in (data["a"], data["b"]):
        box = f'[data-testid="runs-table"] tr[data-run-id="{run_id}"] [data-testid="select-run"]'
        click(browser, box)
    click(browser, '[data-testid="compare-button"]')
    wait(browser, lambda: "#/compare" in browser.current_url, what="compare page not opened")
    for run_id in (data["a"], data["b"]):
        wait(
            browser,
            lambda r=run_id: points(browser, "compare-chart-loss", r) == SHORT_STEPS,
            what="series missing",
        )
    curves = browser.execute_script(  # uPlot's data: [steps, raw a, smoothed a, raw b, smoothed b]
        "const u = document.querySelector(`figure[data-chart='compare-chart-loss']`)._chart.u;"
        "return u && u.data;"
    )
    assert len(curves[0]) == SHORT_STEPS  # both runs logged the same steps
    assert curves[1] != curves[3]  # two different curves (seeds differ)
    legend = browser.find_elements(By.CSS_SELECTOR, '[data-chart="compare-chart-loss"] .legend-item')
    assert {e.get_attribute("data-series") for e in legend} == {data["a"], data["b"]}
    assert "dpo-seed0" in legend[0].text + legend[1].text
    chosen = browser.find_elements(By.CSS_SELECTOR, '[data-testid="compare-metric"]:checked')
    assert [c.get_attribute("value") for c in chosen] == ["loss"]  # the default metric
    screenshot(browser, artifacts, "compare")
    assert_no_console_errors(browser)


def test_dataset_preview(served: httpx.Client, data: dict[str, str], browser: WebDriver) -> None:
    open_page(browser, served, f"/datasets/{data['dataset']}")
    rows = '[data-testid="dataset-preview-row"]'
    wait(browser, lambda: len(browser.find_elements(By.CSS_SELECTOR, rows)) == 20, what="no preview")
    assert "addition-pairs" in text(browser, "datasets-table")
    assert "chosen" in text(browser, "dataset-preview").lower()  # a column (headers are upper-cased by CSS)
    assert_no_console_errors(browser)


def test_run_page_updates_live_while_training(
    served: httpx.Client, data: dict[str, str], browser: WebDriver, artifacts: Path
) -> None:
    run_id = data["long"]
    wait_run(served, run_id, lambda r: r["status"] == "running" and r["progress"]["step"] > 0)
    open_page(browser, served, f"/runs/{run_id}")
    wait(browser, lambda: points(browser, "chart-loss", "loss") > 0, what="no loss chart")
    wait(browser, lambda: "live" in text(browser, "live"), what="stream not connected")
    browser.execute_script("window.__samePage = true")  # a reload would drop it
    before, progress = points(browser, "chart-loss", "loss"), text(browser, "progress")
    assert text(browser, "status") == "running"
    wait(browser, lambda: points(browser, "chart-loss", "loss") >= before + 5, what="chart did not grow")
    wait(browser, lambda: text(browser, "progress") != progress, what="progress did not move")
    assert browser.execute_script("return window.__samePage === true")
    screenshot(browser, artifacts, "run-page-live")

    assert served.post(f"/v1/runs/{run_id}/cancel").status_code == 200
    wait(browser, lambda: text(browser, "status") == "cancelled", timeout=20, what="status not updated")
    wait(browser, lambda: not text(browser, "live"), what="stream not closed")
    # The end of the stream refreshes the run page; the events list shows the final status once redrawn.
    wait(browser, lambda: "cancelled" in text(browser, "events"), what="cancelled event not shown")
    assert browser.execute_script("return window.__samePage === true")
    assert_no_console_errors(browser)
