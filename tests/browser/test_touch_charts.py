"""The dashboard's charts by touch, in headless Chromium emulating a 390 px phone with a touch screen (Chrome
DevTools ``Emulation.setDeviceMetricsOverride`` mobile + ``Emulation.setTouchEmulationEnabled``), fingers put
down, moved and lifted with ``Input.dispatchTouchEvent`` (the browser makes the pointer events, gestures and
scrolling from them as from a real screen): a pinch zooms the x range around its centre, live while the
fingers move and fetched at full resolution once they lift; one finger pans a zoomed chart sideways, within
the data; a vertical swipe over a chart still scrolls the page; pinching back out to the whole run or a double
tap resets.

The data are made as test_charts.py makes them (one run, cancelled at once, then given STEPS steps of its
series), and its helpers read the chart. Skipped without Debian's chromium and chromium-driver, as the other
browser tests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from datetime import timedelta

import httpx
import pytest
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from sqlalchemy import create_engine

from tests.browser import test_dashboard as dashboard
from tests.browser.test_charts import (
    DT,
    STEPS,
    T0,
    add_points,
    chart,
    columns,
    drawn,
    drawn_steps,
    loss,
    reward,
    set_run,
    x_range,
)
from tests.browser.test_dashboard import (
    assert_no_console_errors,
    open_page,
    submit_dpo,
    upload_pairs,
    wait,
    wait_run,
)
from tests.integration.flow import FINISHED, embedded_server

browser = dashboard.browser  # this module's own Chromium (its emulated screen is not the others')

pytestmark = pytest.mark.slow

PHONE = {"width": 390, "height": 844, "deviceScaleFactor": 2, "mobile": True}
FULL = [0, STEPS - 1]  # the whole run's x range (steps)
LOSS = "chart-loss"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, str]]:
    """The server and one succeeded run with STEPS steps of loss and reward/mean."""
    home = tmp_path_factory.mktemp("browser-touch")
    with embedded_server(home) as client:
        run_id = submit_dpo(client, upload_pairs(client, 16), "touch", 20_000)
        assert client.post(f"/v1/runs/{run_id}/cancel").status_code == 200
        wait_run(client, run_id, lambda r: r["status"] in FINISHED, timeout=60)
        db = create_engine(f"sqlite:///{home / 'rlrun.db'}")
        series = {"loss": loss, "reward/mean": reward}
        add_points(db, run_id, series, range(STEPS), lambda s: T0 + timedelta(seconds=DT * s))
        set_run(db, run_id, status="succeeded", step=STEPS, total_steps=STEPS)
        db.dispose()
        yield client, run_id


@pytest.fixture(scope="module")
def phone(browser: WebDriver, run: tuple[httpx.Client, str]) -> WebDriver:
    """The run page on an emulated phone with a touch screen, its loss chart drawn."""
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", PHONE)
    browser.execute_cdp_cmd("Emulation.setTouchEmulationEnabled", {"enabled": True, "maxTouchPoints": 5})
    client, run_id = run
    open_page(browser, client, f"/runs/{run_id}")
    whole = columns(client, run_id, "loss")
    wait(browser, lambda: drawn_steps(browser, LOSS) == whole["step"], what="loss chart not drawn")
    assert browser.execute_script("return [window.innerWidth, navigator.maxTouchPoints > 0]") == [390, True]
    return browser


# ---------- helpers ----------


def plot_box(browser: WebDriver) -> dict[str, float]:
    """The loss chart's plot area (uPlot's .u-over) in viewport px, scrolled to the middle of the screen."""
    box: dict[str, float] = browser.execute_script(
        "const over = document.querySelector(arguments[0]);"
        "over.scrollIntoView({block: 'center'});"
        "const r = over.getBoundingClientRect();"
        "return {left: r.left, top: r.top, width: r.width, height: r.height};",
        f"[data-testid='{LOSS}'] .u-over",
    )
    return box


def touch(browser: WebDriver, kind: str, *points: tuple[float, float]) -> None:
    """One touch event: ``points`` are the fingers on the screen (viewport px), finger i with id i."""
    browser.execute_cdp_cmd(
        "Input.dispatchTouchEvent",
        {"type": kind, "touchPoints": [{"x": x, "y": y, "id": i} for i, (x, y) in enumerate(points)]},
    )


def gesture(browser: WebDriver, start: list[tuple[float, float]], end: list[tuple[float, float]]) -> None:
    """Fingers down at ``start``, moved in 8 even steps to ``end`` (still down)."""
    touch(browser, "touchStart", *start)
    for k in range(1, 9):
        f = k / 8
        touch(
            browser,
            "touchMove",
            *[
                (x0 + f * (x1 - x0), y0 + f * (y1 - y0))
                for (x0, y0), (x1, y1) in zip(start, end, strict=True)
            ],
        )


def lift(browser: WebDriver) -> None:
    touch(browser, "touchEnd")


def zoom_attr(browser: WebDriver) -> list[float] | None:
    """The figure's data-zoom ("min,max" while zoomed) as numbers, else None."""
    value = chart(browser, LOSS, "c.el.dataset.zoom ?? null")
    return None if value is None else [float(v) for v in value.split(",")]


def fetched(browser: WebDriver, client: httpx.Client, run_id: str, lo: float, hi: float) -> list[int]:
    """Waits until the zoomed range is fetched again at full resolution and drawn: the API's points for it at
    the max_points the page asked for (data-fetched "min_step,max_step,max_points"); their steps."""
    s0, s1 = math.floor(lo), math.ceil(hi)
    wait(
        browser,
        lambda: (chart(browser, LOSS, "c.el.dataset.fetched || ''") or "").startswith(f"{s0},{s1},"),
        what=f"range {s0}-{s1} not fetched",
    )
    n = int(chart(browser, LOSS, "c.el.dataset.fetched").split(",")[2])
    part = columns(client, run_id, "loss", max_points=n, min_step=s0, max_step=s1)
    wait(browser, lambda: drawn_steps(browser, LOSS) == part["step"], what="zoomed range not drawn")
    assert drawn(browser, LOSS)[1] == pytest.approx(part["value"], rel=1e-12)
    steps: list[int] = part["step"]
    return steps


def pinch(browser: WebDriver, at: float, d0: float, d1: float, dy: float = 0) -> list[float]:
    """Two fingers at ``at`` (a fraction of the plot's width), ``d0`` px either side, moved to ``d1`` px
    either side (not lifted); the x range expected: the x under each finger stays under it."""
    lo, hi = x_range(browser, LOSS)
    box = plot_box(browser)
    w, c, y = box["width"], box["left"] + at * box["width"], box["top"] + box["height"] / 2
    v0, v1 = (lo + (at * w + d) / w * (hi - lo) for d in (-d0, d0))  # the x under each finger
    span = (v1 - v0) * w / (2 * d1)
    gesture(browser, [(c - d0, y), (c + d0, y)], [(c - d1, y + dy), (c + d1, y + dy)])
    return [v0 - (at * w - d1) / w * span, v0 - (at * w - d1) / w * span + span]


def pan(browser: WebDriver, frac0: float, frac1: float) -> float:
    """One finger from ``frac0`` to ``frac1`` of the plot's width (not lifted); the x shift expected."""
    lo, hi = x_range(browser, LOSS)
    box = plot_box(browser)
    y = box["top"] + box["height"] / 2
    gesture(browser, [(box["left"] + frac0 * box["width"], y)], [(box["left"] + frac1 * box["width"], y)])
    return (frac0 - frac1) * (hi - lo)


def near(got: list[float], want: list[float], tol: float) -> bool:
    return all(abs(g - w) <= tol for g, w in zip(got, want, strict=True))


def scroll_y(browser: WebDriver) -> float:
    value: float = browser.execute_script("return window.scrollY")
    return value


# ---------- tests ----------


def test_pinch_zooms_and_one_finger_pans_within_the_run(
    phone: WebDriver, run: tuple[httpx.Client, str]
) -> None:
    browser = phone
    assert x_range(browser, LOSS) == FULL
    tol = 0.01 * STEPS

    # a one-finger sideways drag on the whole run changes nothing
    pan(browser, 0.7, 0.3)
    lift(browser)
    time.sleep(0.3)
    assert x_range(browser, LOSS) == FULL and zoom_attr(browser) is None

    # pinch: the range follows the fingers while they move; zoomTo (and its fetch) once they lift
    plot_box(browser)
    top = scroll_y(browser)
    want = pinch(browser, 0.9, 15, 105, dy=-40)  # drifting up: a pinch still, not a scroll
    # (the page gets the moves at its next frames: the range is waited for, not read at once)
    wait(browser, lambda: near(x_range(browser, LOSS), want, tol), what=f"pinch: x range not {want}")
    time.sleep(0.2)  # no later move pending
    lo, hi = x_range(browser, LOSS)
    assert hi - lo < (STEPS - 1) / 5  # about 7 times narrower
    assert zoom_attr(browser) is None  # not committed while the fingers are down
    lift(browser)
    wait(browser, lambda: zoom_attr(browser) is not None, what="pinch: zoom not committed")
    assert zoom_attr(browser) == [lo, hi] == x_range(browser, LOSS)
    assert scroll_y(browser) == top
    assert chart(browser, LOSS, "c.resetBtn.hidden") is False
    assert x_range(browser, "chart-reward/mean") == FULL  # only the pinched chart zoomed
    client, run_id = run
    steps = fetched(browser, client, run_id, lo, hi)
    assert len(steps) > 2 * sum(lo <= s <= hi for s in columns(client, run_id, "loss")["step"])

    # one finger pans the zoomed chart: both ends move by the finger's distance in x units
    shift = pan(browser, 0.6, 0.45)  # leftwards: later steps come into view
    wait(browser, lambda: x_range(browser, LOSS)[0] > lo, what="pan: x range not moved")
    lift(browser)
    wait(browser, lambda: zoom_attr(browser) != [lo, hi], what="pan: zoom not committed")
    lo2, hi2 = zoom_attr(browser) or []
    assert shift > 0.1 * (hi - lo)
    assert lo2 - lo == pytest.approx(shift, abs=tol) and hi2 - hi == pytest.approx(shift, abs=tol)
    assert hi2 - lo2 == pytest.approx(hi - lo, rel=1e-9)
    fetched(browser, client, run_id, lo2, hi2)

    # a pan past the last step stops at it
    shift = pan(browser, 0.95, 0.05)
    assert hi2 + shift > FULL[1] + tol  # would have gone past without the clamp
    lift(browser)
    wait(browser, lambda: (zoom_attr(browser) or [0, 0])[1] == FULL[1], what="pan: not clamped to the run")
    lo3, hi3 = zoom_attr(browser) or []
    assert hi3 - lo3 == pytest.approx(hi2 - lo2, rel=1e-9)
    fetched(browser, client, run_id, lo3, hi3)

    # pinching back out past the whole run resets
    pinch(browser, 0.5, 120, 10)
    lift(browser)
    whole = columns(client, run_id, "loss")["step"]
    wait(browser, lambda: drawn_steps(browser, LOSS) == whole, what="pinch out: whole run not drawn")
    assert x_range(browser, LOSS) == FULL and zoom_attr(browser) is None
    assert chart(browser, LOSS, "c.resetBtn.hidden") is True
    label = browser.find_element(By.CSS_SELECTOR, f"[data-testid='{LOSS}']").get_attribute("aria-label")
    assert "pinch" in (label or "") and "pinch" in dashboard.text(browser, "chart-hint")  # said on the page
    assert_no_console_errors(browser)


def test_vertical_swipe_scrolls_the_page_and_double_tap_resets(phone: WebDriver) -> None:
    browser = phone
    assert browser.execute_script("return document.documentElement.scrollHeight - innerHeight") > 300

    def swipe_up() -> None:
        box = plot_box(browser)
        x, y = box["left"] + box["width"] / 2, box["top"] + box["height"] - 5
        before = scroll_y(browser)
        gesture(browser, [(x, y)], [(x, y - 160)])
        lift(browser)
        wait(browser, lambda: scroll_y(browser) > before + 80, what="vertical swipe: page not scrolled")

    swipe_up()  # over the whole run
    assert x_range(browser, LOSS) == FULL and zoom_attr(browser) is None

    pinch(browser, 0.5, 20, 100)
    lift(browser)
    wait(browser, lambda: zoom_attr(browser) is not None, what="pinch: zoom not committed")
    zoomed = x_range(browser, LOSS)
    swipe_up()  # over a zoomed chart: scrolls, and does not pan
    time.sleep(0.3)
    assert x_range(browser, LOSS) == zoomed == zoom_attr(browser)

    box = plot_box(browser)
    at = (box["left"] + box["width"] / 2, box["top"] + box["height"] / 2)
    # A double tap: the browser makes it a dblclick when the second tap comes within its double-tap
    # interval (~300 ms). Each tap is a round trip to the browser, so on a loaded machine the two taps can
    # arrive as two single taps, which change nothing (checked before each try); up to 3 tries.
    for _ in range(3):
        assert zoom_attr(browser) == zoomed, "a single tap changed the zoom"
        for _ in range(2):
            touch(browser, "touchStart", at)
            lift(browser)
            time.sleep(0.05)
        try:
            wait(browser, lambda: zoom_attr(browser) is None, timeout=3)
            break
        except TimeoutException:
            continue
    wait(browser, lambda: zoom_attr(browser) is None, what="double tap: zoom not reset")
    wait(browser, lambda: x_range(browser, LOSS) == FULL, what="double tap: x range not reset")
    assert_no_console_errors(browser)
