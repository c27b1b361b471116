"""The dashboard's charts (uPlot, api/static/vendor/uplot) in headless Chromium against `rlrun serve`, at a
desktop width (1440 px) and a phone width (390 px): drag-zoom that fetches the zoomed range again at full
resolution, reset (button and double-click), smoothing (a debiased EMA, checked against one computed here
from the API's series), log scale (values <= 0 left out and counted), y from zero, wall-time x axis, keyboard
hover synced across the page's charts, the table view, live points appended without a rebuild, and no
horizontal scrolling at 390 px.

No run trains: two tiny DPO runs are submitted and cancelled at once, then given metric points written as the
worker writes them (``api.metric_store.write_points``, which keeps the chart tiers) with known values and
times; one is then shown "running" (held by a worker id no real worker has) so that points written while the
page is open reach it through the live stream.

Same browser and helpers as test_dashboard.py (skipped without Debian's chromium and chromium-driver).
"""

from __future__ import annotations

import math
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from sqlalchemy import Engine, create_engine, update
from sqlalchemy.orm import Session

from api.metric_store import write_points
from api.models import Run
from tests.browser import test_dashboard as dashboard
from tests.browser.test_dashboard import (
    assert_no_console_errors,
    open_page,
    submit_dpo,
    upload_pairs,
    wait,
    wait_run,
)
from tests.integration.flow import FINISHED, embedded_server

browser = dashboard.browser  # this module's own Chromium
artifacts = dashboard.artifacts

pytestmark = pytest.mark.slow

STEPS = 3000  # the long run: more points than a chart loads (app.js CHART_POINTS = 500)
LIVE_STEPS = 50
T0 = datetime(2026, 1, 1, tzinfo=UTC)
DT = 2.0  # seconds between two steps' points
WIDTHS = {"desktop": 1440, "phone": 390}


def loss(step: int) -> float:  # 1.8 to 2.8: far from 0, so "y from 0" moves the axis
    return 2.0 + 0.6 * math.exp(-step / 800) + 0.2 * math.sin(step * 0.37)


def reward(step: int) -> float:  # crosses 0: the log scale has values to leave out
    return 0.5 * math.sin(step / 50) + 0.1


SERIES = {
    "loss": loss,
    "reward/mean": reward,
    "reward/min": lambda s: reward(s) - 0.5,
    "reward/max": lambda s: reward(s) + 0.5,
}


@dataclass(frozen=True)
class Seeded:
    client: httpx.Client
    db: Engine  # the server's SQLite database
    long: str  # succeeded, STEPS steps of SERIES, logged DT seconds apart from T0
    live: str  # "running" with LIVE_STEPS steps of loss; tests add more


def set_run(db: Engine, run_id: str, **values: Any) -> None:
    with db.begin() as conn:
        conn.execute(update(Run).where(Run.id == uuid.UUID(run_id)).values(**values))


def add_points(db: Engine, run_id: str, keys: dict[str, Any], steps: range, at: Any) -> None:
    """Metric points as the worker's flush writes them (with their chart tiers); at(step) -> logged_at."""
    rows = [
        {"run_id": uuid.UUID(run_id), "key": k, "step": s, "value": f(s), "logged_at": at(s)}
        for s in steps
        for k, f in keys.items()
    ]
    with Session(db) as session, session.begin():
        write_points(session, rows)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    home = tmp_path_factory.mktemp("browser-charts")
    with embedded_server(home) as client:
        dataset_id = upload_pairs(client, 16)
        ids = [submit_dpo(client, dataset_id, name, 20_000) for name in ("long", "live")]
        for run_id in ids:
            assert client.post(f"/v1/runs/{run_id}/cancel").status_code == 200
        for run_id in ids:
            wait_run(client, run_id, lambda r: r["status"] in FINISHED, timeout=60)
        db = create_engine(f"sqlite:///{home / 'rlrun.db'}")
        long, live = ids
        add_points(db, long, SERIES, range(STEPS), lambda s: T0 + timedelta(seconds=DT * s))
        set_run(db, long, status="succeeded", step=STEPS, total_steps=STEPS)
        now = datetime.now(UTC)
        ten_ago = now - timedelta(minutes=10)
        add_points(db, live, {"loss": loss}, range(LIVE_STEPS), lambda s: ten_ago + timedelta(seconds=s))
        set_run(
            db,
            live,
            status="running",
            step=LIVE_STEPS,
            total_steps=20_000,
            worker_id="elsewhere",
            lease_expires_at=now + timedelta(hours=1),
            started_at=ten_ago,
            finished_at=None,
            cancel_requested=False,
            error=None,
        )
        try:
            yield Seeded(client, db, long, live)
        finally:  # ended, so that no page left open holds a stream while the server stops
            set_run(db, live, status="cancelled", finished_at=datetime.now(UTC), lease_expires_at=None)
            db.dispose()


# ---------- helpers ----------


def sized(browser: WebDriver, width: int) -> None:
    browser.set_window_size(width, 1000)
    assert browser.execute_script("return window.innerWidth") == width


def chart(browser: WebDriver, testid: str, expr: str, *args: Any) -> Any:
    """``expr`` evaluated in the page with ``c`` the chart whose figure has data-chart=testid (its Chart
    object; ``c.u`` the uPlot) and ``args`` the extra arguments; null when there is no such chart."""
    return browser.execute_script(
        "const fig = document.querySelector(`figure[data-chart='${CSS.escape(arguments[0])}']`);"
        "const c = fig && fig._chart; const args = [...arguments].slice(1);"
        f"return c ? ({expr}) : null;",
        testid,
        *args,
    )


def drawn(browser: WebDriver, testid: str) -> Any:
    """The chart's uPlot data ([x, raw 1, smoothed 1, ...]) once drawn, else null."""
    return chart(browser, testid, "c.u && !c.frame ? c.u.data : null")


def drawn_steps(browser: WebDriver, testid: str) -> list[Any]:
    """The drawn x values, or [] while a frame is pending: a wait's predicate must not index null (a
    reset or an appended point can leave a frame pending at the moment the wait polls)."""
    data = drawn(browser, testid)
    return [] if data is None else list(data[0])


def columns(client: httpx.Client, run_id: str, key: str, max_points: int = 500, **params: Any) -> Any:
    resp = client.get(
        f"/v1/runs/{run_id}/metrics",
        params={"format": "columns", "max_points": max_points, "key": key, **params},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()[key]


def open_run(browser: WebDriver, s: Seeded, run_id: str, points: int) -> None:
    browser.get("about:blank")  # a fresh page, even when the last test left this one open
    open_page(browser, s.client, f"/runs/{run_id}")
    wait(
        browser,
        lambda: (d := drawn(browser, "chart-loss")) is not None and len(d[0]) == points,
        what="loss chart not drawn",
    )


def drag(browser: WebDriver, testid: str, frac0: float, frac1: float) -> None:
    """Press, move and release the mouse across the plot area, from frac0 to frac1 of its width."""
    over = browser.find_element(By.CSS_SELECTOR, f"[data-testid='{testid}'] .u-over")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", over)
    w = over.size["width"]
    start = round(w * frac0 - w / 2)  # offsets from the element's centre
    ActionChains(browser).move_to_element_with_offset(over, start, 0).click_and_hold().move_by_offset(
        round(w * (frac1 - frac0)), 0
    ).release().perform()


def ema(values: list[float | None], w: float) -> list[float | None]:
    """TensorBoard's debiased exponential moving average, written out again here."""
    out: list[float | None] = []
    last, n = 0.0, 0
    for v in values:
        if v is None:
            out.append(None)
            continue
        last = last * w + (1 - w) * v
        n += 1
        out.append(last / (1 - w**n))
    return out


def set_control(browser: WebDriver, testid: str, value: Any) -> None:
    """Set a chart control as a user does: a range/select value or a checkbox click (firing its event)."""
    el = browser.find_element(By.CSS_SELECTOR, f"[data-testid='{testid}']")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", el)
    if el.get_attribute("type") == "checkbox":
        if el.is_selected() != bool(value):
            el.click()
        return
    browser.execute_script(
        "const el = arguments[0]; el.value = arguments[1];"
        "el.dispatchEvent(new Event(el.type === 'range' ? 'input' : 'change', {bubbles: true}));",
        el,
        str(value),
    )


def shot(browser: WebDriver, folder: Path, name: str) -> None:
    """A full-page PNG at the window's width (test_dashboard.screenshot's, which widens the window)."""
    width = browser.execute_script("return window.innerWidth")
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(width, min(max(int(height), 800), 4000))
    time.sleep(0.3)
    path = folder / f"{name}.png"
    assert browser.save_screenshot(str(path)), path
    browser.set_window_size(width, 1000)
    print(f"\nscreenshot: {path}")  # noqa: T201
    if target := os.environ.get("RLRUN_TEST_ARTIFACTS"):
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / path.name)


def legend(browser: WebDriver, testid: str, series: str, part: str = "") -> Any:
    """The legend item of a series in a chart (``part``: a descendant of it, e.g. "b" for its value)."""
    css = f"[data-chart='{testid}'] .legend-item[data-series='{series}'] {part}"
    return browser.find_element(By.CSS_SELECTOR, css.strip())


def x_range(browser: WebDriver, testid: str) -> Any:
    return chart(browser, testid, "[c.u.scales.x.min, c.u.scales.x.max]")


def no_horizontal_scroll(browser: WebDriver) -> None:
    widths = browser.execute_script(
        "const rights = [...document.querySelectorAll('.uplot')].map((u) => u.getBoundingClientRect().right);"
        "return [document.documentElement.scrollWidth, window.innerWidth, Math.max(0, ...rights)];"
    )
    assert widths[0] <= widths[1], f"page {widths[0]} px wide in a {widths[1]} px window"
    assert widths[2] <= widths[1], f"a chart reaches {widths[2]} px in a {widths[1]} px window"


# ---------- tests ----------


@pytest.mark.parametrize("width", WIDTHS.values(), ids=WIDTHS.keys())
def test_zoom_fetches_the_range_at_full_resolution_and_resets(
    seeded: Seeded, browser: WebDriver, width: int
) -> None:
    sized(browser, width)
    whole = columns(seeded.client, seeded.long, "loss")
    assert len(whole["step"]) < STEPS  # downsampled: what the page loads
    open_run(browser, seeded, seeded.long, len(whole["step"]))
    data = drawn(browser, "chart-loss")
    assert data[0] == whole["step"] and data[1] == pytest.approx(whole["value"], rel=1e-12)
    full = x_range(browser, "chart-loss")
    assert full == [0, STEPS - 1]
    assert chart(browser, "chart-loss", "c.resetBtn.hidden") is True

    drag(browser, "chart-loss", 0.4, 0.5)
    lo, hi = x_range(browser, "chart-loss")
    span = STEPS - 1
    assert lo == pytest.approx(0.4 * span, abs=0.03 * span)
    assert hi == pytest.approx(0.5 * span, abs=0.03 * span)
    wait(browser, lambda: chart(browser, "chart-loss", "c.el.dataset.fetched || ''"), what="no refetch")
    s0, s1, n = map(int, chart(browser, "chart-loss", "c.el.dataset.fetched").split(","))
    assert (s0, s1) == (math.floor(lo), math.ceil(hi))
    plot_width = chart(browser, "chart-loss", "c.plot.clientWidth")
    assert n == min(2000, plot_width)
    part = columns(seeded.client, seeded.long, "loss", max_points=n, min_step=s0, max_step=s1)
    assert part["step"] == list(range(s0, s1 + 1))  # every step of the range: at full resolution
    wait(browser, lambda: drawn_steps(browser, "chart-loss") == part["step"], what="zoomed range not drawn")
    assert drawn(browser, "chart-loss")[1] == pytest.approx([loss(s) for s in part["step"]], rel=1e-12)
    before = sum(s0 <= s <= s1 for s in whole["step"])
    assert len(part["step"]) > 2 * before  # more points in range than the whole-run series had
    assert x_range(browser, "chart-loss") == [lo, hi]  # zoom kept
    assert x_range(browser, "chart-reward/mean") == full  # only this chart zoomed
    points = legend(browser, "chart-loss", "loss")
    assert points.get_attribute("data-points") == str(len(part["step"]))

    browser.find_element(By.CSS_SELECTOR, "[data-chart='chart-loss'] [data-testid='reset-zoom']").click()
    wait(
        browser,
        lambda: drawn_steps(browser, "chart-loss") == whole["step"],
        what="reset: whole run not drawn",
    )
    assert x_range(browser, "chart-loss") == full
    assert chart(browser, "chart-loss", "c.resetBtn.hidden") is True
    assert points.get_attribute("data-points") == str(len(whole["step"]))

    drag(browser, "chart-loss", 0.1, 0.3)  # and double-click resets too
    assert chart(browser, "chart-loss", "c.u.scales.x.max") < 0.35 * span
    over = browser.find_element(By.CSS_SELECTOR, "[data-testid='chart-loss'] .u-over")
    ActionChains(browser).double_click(over).perform()
    wait(browser, lambda: x_range(browser, "chart-loss") == full, what="double-click: x not reset")
    wait(browser, lambda: drawn_steps(browser, "chart-loss") == whole["step"], what="double-click: not reset")
    assert chart(browser, "chart-loss", "'zoom' in c.el.dataset") is False
    assert_no_console_errors(browser)


def test_smoothing_is_a_debiased_ema_over_the_raw_series(
    seeded: Seeded, browser: WebDriver, artifacts: Path
) -> None:
    sized(browser, WIDTHS["desktop"])
    whole = columns(seeded.client, seeded.long, "loss")
    open_run(browser, seeded, seeded.long, len(whole["step"]))
    data = drawn(browser, "chart-loss")
    assert chart(browser, "chart-loss", "c.u.series[2].show") is False  # no smoothing: the raw line only

    set_control(browser, "chart-smoothing", 0.9)
    wait(browser, lambda: chart(browser, "chart-loss", "c.u && c.u.series[2].show && !c.frame"))
    data = drawn(browser, "chart-loss")
    expected = ema(whole["value"], 0.9)
    assert data[0] == whole["step"]
    assert data[1] == pytest.approx(whole["value"], rel=1e-12)  # the raw line, drawn faint behind
    assert data[2] == pytest.approx(expected, rel=1e-9)
    assert max(abs(a - b) for a, b in zip(data[2], whole["value"], strict=True)) > 0.1  # visibly smoother
    assert browser.find_element(By.CSS_SELECTOR, "[data-testid='chart-smoothing-value']").text == "0.90"
    shown = legend(browser, "chart-loss", "loss", "b").text
    assert shown == f"{expected[-1]:.4g} raw {whole['value'][-1]:.4g}"
    shot(browser, artifacts, "charts-smoothed")

    set_control(browser, "chart-smoothing", 0)
    wait(browser, lambda: chart(browser, "chart-loss", "c.u && !c.u.series[2].show && !c.frame"))
    assert drawn(browser, "chart-loss")[2] == pytest.approx(whole["value"], rel=1e-12)
    assert_no_console_errors(browser)


def test_log_scale_zero_baseline_and_wall_time(seeded: Seeded, browser: WebDriver) -> None:
    sized(browser, WIDTHS["desktop"])
    whole = columns(seeded.client, seeded.long, "loss")
    open_run(browser, seeded, seeded.long, len(whole["step"]))
    keys = ("reward/mean", "reward/min", "reward/max")
    rewards = [columns(seeded.client, seeded.long, k)["value"] for k in keys]
    nonpositive = sum(v <= 0 for vs in rewards for v in vs)
    assert nonpositive > 0
    assert chart(browser, "chart-reward/mean", "c.u.scales.y.distr") == 1
    linear = drawn(browser, "chart-reward/mean")

    set_control(browser, "chart-log", True)
    wait(browser, lambda: chart(browser, "chart-reward/mean", "c.u && !c.frame && c.u.scales.y.distr") == 3)
    note = browser.find_element(By.CSS_SELECTOR, "[data-chart='chart-reward/mean'] [data-testid=chart-note]")
    assert note.text == f"log scale: {nonpositive} values ≤ 0 not shown"
    data = drawn(browser, "chart-reward/mean")
    assert data[0] == linear[0]
    for k in range(1, len(data)):  # each series as before, less its values <= 0
        assert data[k] == [None if v is None or v <= 0 else v for v in linear[k]]
    y0, y1 = chart(browser, "chart-reward/mean", "[c.u.scales.y.min, c.u.scales.y.max]")
    assert 0 < y0 < y1 and math.isfinite(y1)
    assert chart(browser, "chart-loss", "c.u.scales.y.distr") == 3
    set_control(browser, "chart-log", False)
    wait(browser, lambda: chart(browser, "chart-reward/mean", "c.u && !c.frame && c.u.scales.y.distr") == 1)
    assert not note.is_displayed()

    y0 = chart(browser, "chart-loss", "c.u.scales.y.min")
    assert y0 > 1  # the loss is 1.8 to 2.8
    set_control(browser, "chart-zero", True)
    wait(browser, lambda: chart(browser, "chart-loss", "c.u && !c.frame && c.u.scales.y.min") == 0)
    assert chart(browser, "chart-loss", "c.u.scales.y.max") > max(whole["value"])
    set_control(browser, "chart-zero", False)
    wait(browser, lambda: chart(browser, "chart-loss", "c.u && !c.frame && c.u.scales.y.min") > 1)

    timed = columns(seeded.client, seeded.long, "loss", time="true")
    assert timed["time"] == pytest.approx(
        [(T0 + timedelta(seconds=DT * s)).timestamp() for s in timed["step"]], abs=1e-3
    )
    set_control(browser, "chart-x", "time")
    wait(browser, lambda: chart(browser, "chart-loss", "c.u && !c.frame && c.u.scales.x.time") is True)
    data = drawn(browser, "chart-loss")
    assert data[0] == pytest.approx(timed["time"], abs=1e-6)
    assert data[1] == pytest.approx(timed["value"], rel=1e-12)
    assert chart(browser, "chart-loss", "c.u.axes[0].label") == "wall time"
    assert chart(browser, "chart-loss", "c.u.axes[1].label") == "Loss"
    set_control(browser, "chart-x", "step")
    wait(browser, lambda: chart(browser, "chart-loss", "c.u && !c.frame && c.u.scales.x.time") is False)
    assert drawn(browser, "chart-loss")[0] == whole["step"]
    assert chart(browser, "chart-loss", "c.u.axes[0].label") == "step"
    assert_no_console_errors(browser)


@pytest.mark.parametrize("width", WIDTHS.values(), ids=WIDTHS.keys())
def test_arrow_keys_move_the_cursor_on_every_chart(seeded: Seeded, browser: WebDriver, width: int) -> None:
    sized(browser, width)
    whole = columns(seeded.client, seeded.long, "loss")
    open_run(browser, seeded, seeded.long, len(whole["step"]))
    plot = browser.find_element(By.CSS_SELECTOR, "[data-testid='chart-loss']")
    assert plot.get_attribute("tabindex") == "0" and "arrow keys" in (plot.get_attribute("aria-label") or "")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'}); arguments[0].focus()", plot)
    said = browser.find_element(By.CSS_SELECTOR, "[data-chart='chart-loss'] [data-testid='chart-said']")
    assert said.get_attribute("aria-live") == "polite"
    value_shown = legend(browser, "chart-loss", "loss", "b")
    reward_steps = drawn(browser, "chart-reward/mean")[0]
    for presses, idx in ((1, 0), (2, 2), (-1, 1)):
        key = Keys.ARROW_RIGHT if presses > 0 else Keys.ARROW_LEFT
        ActionChains(browser).send_keys(key * abs(presses)).perform()
        assert chart(browser, "chart-loss", "c.u.cursor.idx") == idx
        step, value = whole["step"][idx], whole["value"][idx]
        assert value_shown.text == f"{value:.4g}"
        assert said.get_attribute("textContent") == f"step {step}: loss {value:.4g}"
        # the hover is synced: the reward chart's cursor is at its nearest step
        nearest = min(reward_steps, key=lambda x: abs(x - step))
        assert chart(browser, "chart-reward/mean", "c.u.data[0][c.u.cursor.idx]") == nearest
    ActionChains(browser).send_keys(Keys.END).perform()
    assert chart(browser, "chart-loss", "c.u.cursor.idx") == len(whole["step"]) - 1
    ActionChains(browser).send_keys(Keys.ARROW_RIGHT).perform()  # stays at the last point
    assert chart(browser, "chart-loss", "c.u.cursor.idx") == len(whole["step"]) - 1
    ActionChains(browser).send_keys(Keys.ESCAPE).perform()
    assert chart(browser, "chart-loss", "c.u.cursor.left") < 0
    assert_no_console_errors(browser)


def test_table_view_lists_the_loaded_points(seeded: Seeded, browser: WebDriver) -> None:
    sized(browser, WIDTHS["desktop"])
    keys = ("reward/mean", "reward/min", "reward/max")
    api = {k: columns(seeded.client, seeded.long, k) for k in keys}
    steps = sorted({s for c in api.values() for s in c["step"]})
    open_run(browser, seeded, seeded.long, len(columns(seeded.client, seeded.long, "loss")["step"]))
    box = "[data-chart='chart-reward/mean'] [data-testid='chart-table']"
    browser.find_element(By.CSS_SELECTOR, f"{box} summary").click()
    wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, f"{box} tbody tr"), what="no table")
    head = [th.text for th in browser.find_elements(By.CSS_SELECTOR, f"{box} thead th")]
    assert [t.lower() for t in head] == ["step", *keys]  # headers are upper-cased by CSS
    rows: list[list[Any]] = browser.execute_script(
        "const value = (td) => (td.dataset.value === '' ? null : Number(td.dataset.value));"
        "return [...document.querySelectorAll(arguments[0])]"
        "  .map((tr) => [Number(tr.dataset.step), ...[...tr.querySelectorAll('td')].map(value)]);",
        f"{box} tbody tr",
    )
    shown = steps[-200:]
    assert [r[0] for r in rows] == shown
    for k, key in enumerate(keys):
        by_step = dict(zip(api[key]["step"], api[key]["value"], strict=True))
        assert [r[1 + k] for r in rows] == [by_step.get(s) for s in shown]
    note = browser.find_element(By.CSS_SELECTOR, f"{box} [data-testid='chart-table-note']").text
    assert note == f"the last 200 of {len(steps)} steps loaded"
    assert_no_console_errors(browser)


def test_live_points_are_appended_to_the_same_chart(seeded: Seeded, browser: WebDriver) -> None:
    sized(browser, WIDTHS["desktop"])
    open_run(browser, seeded, seeded.live, LIVE_STEPS)
    wait(browser, lambda: "live" in dashboard.text(browser, "live"), what="stream not connected")
    browser.execute_script("window.__u = document.querySelector(`figure[data-chart='chart-loss']`)._chart.u")
    plot = browser.find_element(By.CSS_SELECTOR, "[data-testid='chart-loss']")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'}); arguments[0].focus()", plot)
    ActionChains(browser).send_keys(Keys.ARROW_RIGHT * 3).perform()  # a hover at step 2
    assert chart(browser, "chart-loss", "c.u.cursor.idx") == 2

    now = datetime.now(UTC)
    add_points(seeded.db, seeded.live, {"loss": loss}, range(LIVE_STEPS, LIVE_STEPS + 20), lambda s: now)
    wait(
        browser,
        lambda: len(drawn_steps(browser, "chart-loss")) == LIVE_STEPS + 20,
        what="points not appended",
    )
    data = drawn(browser, "chart-loss")
    assert data[0] == list(range(LIVE_STEPS + 20))
    assert data[1] == pytest.approx([loss(s) for s in range(LIVE_STEPS + 20)], rel=1e-12)
    assert chart(browser, "chart-loss", "c.u === window.__u") is True  # not built again
    assert chart(browser, "chart-loss", "c.u.cursor.idx") == 2  # the hover is where it was

    drag(browser, "chart-loss", 0.2, 0.5)
    wait(browser, lambda: chart(browser, "chart-loss", "c.el.dataset.fetched || ''"), what="no refetch")
    zoomed = x_range(browser, "chart-loss")
    now = datetime.now(UTC)
    add_points(seeded.db, seeded.live, {"loss": loss}, range(LIVE_STEPS + 20, LIVE_STEPS + 30), lambda s: now)
    wait(
        browser,
        lambda: chart(browser, "chart-loss", "c.full.get('loss').step.length") == LIVE_STEPS + 30,
        what="points not appended while zoomed",
    )
    time.sleep(0.2)  # a frame: the zoomed chart redraws
    assert x_range(browser, "chart-loss") == zoomed  # zoom kept
    assert chart(browser, "chart-loss", "c.u === window.__u") is True
    browser.find_element(By.CSS_SELECTOR, "[data-chart='chart-loss'] [data-testid='reset-zoom']").click()
    wait(
        browser, lambda: drawn_steps(browser, "chart-loss") == list(range(LIVE_STEPS + 30)), what="not reset"
    )
    browser.get("about:blank")  # closes the live stream
    assert_no_console_errors(browser)


def test_phone_width_has_no_horizontal_scroll(seeded: Seeded, browser: WebDriver, artifacts: Path) -> None:
    sized(browser, WIDTHS["phone"])
    open_run(browser, seeded, seeded.long, len(columns(seeded.client, seeded.long, "loss")["step"]))
    browser.execute_script("document.querySelectorAll('details').forEach((d) => { d.open = true; })")
    charts = "[...document.querySelectorAll('figure[data-chart]')].map((f) => f._chart)"
    wait(
        browser,
        lambda: browser.execute_script(f"return {charts}.every((c) => c.u && !c.frame)"),
        what="charts not drawn",
    )
    widths = browser.execute_script(f"return {charts}.map((c) => [c.u.width, c.plot.clientWidth])")
    assert widths and all(0 < u <= plot for u, plot in widths), widths
    no_horizontal_scroll(browser)
    controls = browser.find_element(By.CSS_SELECTOR, ".chart-controls")
    assert browser.execute_script("return arguments[0].scrollWidth <= arguments[0].clientWidth", controls)
    shot(browser, artifacts, "charts-phone")

    open_page(browser, seeded.client, f"/compare?runs={seeded.long},{seeded.live}&key=loss")
    wait(browser, lambda: drawn(browser, "compare-chart-loss") is not None, what="compare chart not drawn")
    items = browser.find_elements(By.CSS_SELECTOR, "[data-chart='compare-chart-loss'] .legend-item")
    assert [e.get_attribute("data-series") for e in items] == [seeded.long, seeded.live]
    no_horizontal_scroll(browser)
    set_control(browser, "chart-x", "time")  # the runs on one wall-clock axis
    times = [columns(seeded.client, r, "loss", time="true") for r in (seeded.long, seeded.live)]
    wait(
        browser, lambda: chart(browser, "compare-chart-loss", "c.u && !c.frame && c.u.scales.x.time") is True
    )
    data = drawn(browser, "compare-chart-loss")
    assert data[0] == pytest.approx(sorted({t for c in times for t in c["time"]}), abs=1e-6)
    no_horizontal_scroll(browser)
    browser.get("about:blank")  # the live run's compare page polls it
    assert_no_console_errors(browser)
