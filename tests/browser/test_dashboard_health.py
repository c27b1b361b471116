"""The dashboard shows a run's long phase and its health warnings, in headless Chromium against `rlrun serve`:
the runs table's ⚠ badge and its "flagged" filter (``GET /v1/runs?flagged=``), the phase in place of
``step 0/N`` (runs table, run page, compare table), the run page's warnings list, and both kept up to date
by the live view.

No run trains: three tiny DPO runs are submitted and cancelled at once, then their rows are set in the
server's SQLite database as a worker would leave them (``warnings``/``warning_count``, ``phase``/
``phase_done``/``phase_total``, ``progress`` and ``warning`` events). The one shown "running" is held by a
worker id no real worker has, with a lease an hour away, so nothing claims it or gives it back.

Same browser and helpers as test_dashboard.py (skipped without Debian's chromium and chromium-driver).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select
from sqlalchemy import Engine, create_engine, insert, update

from api.models import Event, Run
from tests.browser import test_dashboard as dashboard
from tests.browser.test_dashboard import (
    assert_no_console_errors,
    open_page,
    screenshot,
    submit_dpo,
    text,
    upload_pairs,
    wait,
    wait_run,
)
from tests.integration.flow import FINISHED, embedded_server

# test_dashboard's Chromium (this module gets its own) and screenshot folder
browser = dashboard.browser
artifacts = dashboard.artifacts

pytestmark = pytest.mark.slow

WARNINGS: list[dict[str, Any]] = [
    {"code": "zero_advantage", "step": 3, "message": "every group's rewards were equal at steps 1, 2, 3"},
    {"code": "kl_diverging", "step": 7, "message": "kl/ref 1.4 above 1 nats per token at steps 5, 6, 7"},
]


@dataclass(frozen=True)
class Seeded:
    client: httpx.Client
    db: Engine  # the server's SQLite database
    flagged: str  # ended, with WARNINGS
    clean: str  # ended, no warnings
    phase: str  # "running", 120 of 1,300 rows into its reference pass, no step taken


def set_run(db: Engine, run_id: str, **values: Any) -> None:
    """Set a run's columns, as the worker's transitions and DbReporter do."""
    with db.begin() as conn:
        conn.execute(update(Run).where(Run.id == uuid.UUID(run_id)).values(**values))


def add_event(db: Engine, run_id: str, kind: str, message: str, data: dict[str, Any]) -> None:
    with db.begin() as conn:
        conn.execute(insert(Event).values(run_id=uuid.UUID(run_id), kind=kind, message=message, data=data))


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    home = tmp_path_factory.mktemp("browser-health")
    with embedded_server(home) as client:
        dataset_id = upload_pairs(client, 16)
        ids = [submit_dpo(client, dataset_id, name, 20_000) for name in ("flagged", "clean", "phase")]
        for run_id in ids:  # queued: cancelled at once; already claimed: within a step
            assert client.post(f"/v1/runs/{run_id}/cancel").status_code == 200
        for run_id in ids:
            wait_run(client, run_id, lambda r: r["status"] in FINISHED, timeout=60)
        db = create_engine(f"sqlite:///{home / 'rlrun.db'}")
        flagged, clean, phase = ids
        set_run(db, flagged, status="succeeded", warnings=WARNINGS, warning_count=len(WARNINGS))
        now = datetime.now(UTC)
        set_run(
            db,
            phase,
            status="running",
            step=0,
            total_steps=300,
            phase="reference",
            phase_done=120,
            phase_total=1300,
            worker_id="elsewhere",
            lease_expires_at=now + timedelta(hours=1),
            started_at=now,
            finished_at=None,
            cancel_requested=False,
            error=None,
        )
        try:
            yield Seeded(client, db, flagged, clean, phase)
        finally:  # ended, so that no page left open holds a stream while the server stops
            set_run(
                db,
                phase,
                status="cancelled",
                phase=None,
                phase_done=None,
                phase_total=None,
                finished_at=datetime.now(UTC),
                lease_expires_at=None,
            )
            db.dispose()


# ---------- helpers ----------


def flat(browser: WebDriver, testid: str) -> str:
    """The element's visible text, each run of whitespace (line breaks between flex items) as one space."""
    return " ".join(text(browser, testid).split())


def row_ids(browser: WebDriver) -> set[str]:
    found: list[str] = browser.execute_script(
        "return [...document.querySelectorAll('[data-testid=run-row]')].map((tr) => tr.dataset.runId);"
    )
    return set(found)


def in_row(browser: WebDriver, run_id: str, testid: str) -> dict[str, Any] | None:
    """The text, title and aria-label of the element with ``testid`` in the run's table row (None: none)."""
    found: dict[str, Any] | None = browser.execute_script(
        "const el = document.querySelector("
        "  `tr[data-run-id='${arguments[0]}'] [data-testid='${arguments[1]}']`);"
        "const bar = el && el.closest('.progress');"
        "return el && { text: el.innerText.trim(), title: el.title, label: el.getAttribute('aria-label'),"
        "  phase: bar && bar.dataset.phase, fill: bar && bar.querySelector('.progress-fill').style.width };",
        run_id,
        testid,
    )
    return found


# ---------- tests ----------


def test_runs_table_badges_flagged_runs_and_filters_them(
    seeded: Seeded, browser: WebDriver, artifacts: Path
) -> None:
    everyone = {seeded.flagged, seeded.clean, seeded.phase}
    open_page(browser, seeded.client, "/runs")
    wait(browser, lambda: row_ids(browser) >= everyone, what="runs not listed")
    badge = in_row(browser, seeded.flagged, "warning-badge")
    assert (
        badge is not None and badge["text"] == "⚠ zero_advantage, kl_diverging"
    )  # the codes, not only a colour
    assert badge["label"] == badge["title"] == "2 warnings: zero_advantage, kl_diverging"
    assert in_row(browser, seeded.clean, "warning-badge") is None
    assert in_row(browser, seeded.phase, "warning-badge") is None
    progress = in_row(browser, seeded.phase, "progress-text")
    assert progress == {
        "text": "reference log-probs 120 / 1,300",
        "title": "",
        "label": None,
        "phase": "reference",
        "fill": "9.2%",  # 120 / 1300, not step 0 / 300
    }
    screenshot(browser, artifacts, "runs-health")

    Select(browser.find_element(By.CSS_SELECTOR, '[data-testid="filter-flagged"]')).select_by_value("true")
    wait(browser, lambda: row_ids(browser) == {seeded.flagged}, what="flagged filter not applied")
    assert "flagged=true" in browser.current_url
    Select(browser.find_element(By.CSS_SELECTOR, '[data-testid="filter-flagged"]')).select_by_value("false")
    wait(
        browser, lambda: row_ids(browser) == {seeded.clean, seeded.phase}, what="unflagged filter not applied"
    )

    open_page(browser, seeded.client, "/runs?flagged=true")  # the filter is in the link
    wait(browser, lambda: row_ids(browser) == {seeded.flagged}, what="flagged filter not read from the URL")
    select = browser.find_element(By.CSS_SELECTOR, '[data-testid="filter-flagged"]')
    assert select.get_attribute("value") == "true"
    assert_no_console_errors(browser)


def test_run_pages_show_the_phase_and_the_warnings_live(
    seeded: Seeded, browser: WebDriver, artifacts: Path
) -> None:
    open_page(browser, seeded.client, f"/runs/{seeded.flagged}")
    wait(browser, lambda: "kl_diverging" in text(browser, "run-warnings"), what="no warnings list")
    items = browser.find_elements(By.CSS_SELECTOR, '[data-testid="run-warnings"] [data-testid="run-warning"]')
    assert [i.get_attribute("data-code") for i in items] == ["zero_advantage", "kl_diverging"]
    assert [" ".join(i.text.split()) for i in items] == [  # visible text, not a tooltip
        f"zero_advantage at step 3 {WARNINGS[0]['message']}",
        f"kl_diverging at step 7 {WARNINGS[1]['message']}",
    ]

    open_page(browser, seeded.client, f"/runs/{seeded.clean}")
    wait(browser, lambda: text(browser, "status") == "cancelled", what="run page not shown")
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="run-warnings"]')

    open_page(browser, seeded.client, f"/runs/{seeded.phase}")
    wait(browser, lambda: "live" in text(browser, "live"), what="stream not connected")
    time.sleep(1)  # the stream's first status message (it has no phase fields) has come: the phase stays
    assert flat(browser, "progress") == "reference log-probs 120 / 1,300 9%"
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="run-warnings"]')
    browser.execute_script("window.__samePage = true")  # a reload would drop it

    # the worker moves on: a progress event, then a warning (each with the columns it sets)
    set_run(seeded.db, seeded.phase, phase_done=650)
    add_event(
        seeded.db,
        seeded.phase,
        "progress",
        "reference 650/1300",
        {"phase": "reference", "done": 650, "total": 1300},
    )
    wait(
        browser,
        lambda: flat(browser, "progress") == "reference log-probs 650 / 1,300 50%",
        timeout=5,
        what="progress event not shown",
    )
    set_run(
        seeded.db,
        seeded.phase,
        phase="model_load",
        phase_done=None,
        phase_total=None,
        warnings=WARNINGS[:1],
        warning_count=1,
    )
    add_event(
        seeded.db, seeded.phase, "warning", WARNINGS[0]["message"], {"code": "zero_advantage", "step": 3}
    )
    wait(
        browser,
        lambda: "zero_advantage" in text(browser, "run-warnings"),
        timeout=5,
        what="warning not shown",
    )
    assert flat(browser, "progress") == "loading model…"  # read again with the run: no total, no percent
    assert browser.execute_script("return window.__samePage === true")
    screenshot(browser, artifacts, "run-page-phase")

    open_page(browser, seeded.client, f"/compare?runs={seeded.phase},{seeded.flagged}")
    wait(browser, lambda: "loading model…" in text(browser, "compare-table"), what="compare table")
    cells = browser.find_elements(
        By.CSS_SELECTOR, '[data-testid="compare-table"] [data-testid="warning-badge"]'
    )
    assert [c.text for c in cells] == ["⚠ zero_advantage", "⚠ zero_advantage, kl_diverging"]
    browser.get("about:blank")  # closes the live stream before the server stops
    assert_no_console_errors(browser)
