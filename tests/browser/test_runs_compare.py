"""The runs table, the compare page and the run page's events, samples and spec in headless Chromium against
`rlrun serve`, at 1440 px and 390 px: sorting by a header (the API's order for that sort), search (the API's
``q`` answer), editing a run's tags then filtering by one, the per-algorithm key metric, the ⚠ badge naming
its codes, comparing runs (one chart per metric, each run one colour everywhere, and a diff table of exactly
the spec fields that differ, worked out here from the two specs), cloning a run from its spec, a failed event
marked in words with its reason in view, samples across steps with a search, no horizontal scrolling at
390 px, WCAG contrast of key text in the light and dark themes, and an accessible name on every control.

No run trains: four tiny DPO runs (different names, learning rates and seeds) are submitted and cancelled at
once, then set in the server's SQLite database as a worker leaves them (status, warnings, metric points,
events, samples). The clone the test submits is cancelled as soon as it exists.

Same browser and helpers as test_dashboard.py (skipped without Debian's chromium and chromium-driver).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select
from sqlalchemy import Engine, create_engine, insert, update
from sqlalchemy.orm import Session

from api.metric_store import write_points
from api.models import Event, Run, RunSample
from tests.browser import test_dashboard as dashboard
from tests.browser.test_dashboard import (
    assert_no_console_errors,
    click,
    open_page,
    submit_dpo,
    text,
    upload_pairs,
    wait,
    wait_run,
)
from tests.integration.flow import FINISHED, embedded_server

browser = dashboard.browser  # this module's own Chromium

pytestmark = pytest.mark.slow

WIDTHS = {"desktop": 1440, "phone": 390}
REASON = "CUDA out of memory while computing the reference log-probs"
WARNING = {"code": "loss_diverging", "step": 9, "message": "loss 41.2 is 10x its early median"}


# A multi-turn tool episode's sample (trainer/loops/rollouts.py sample_records): a call that failed, a
# retry, the tool's answer, the final answer.
TRANSCRIPT_SAMPLE: dict[str, Any] = {
    "step": 3,
    "prompt": "What is 17*23?",
    "completion": "...",
    "reward": 1.0,
    "data": {
        "answer": "391",
        "ended": "answer",
        "transcript": [
            {"role": "assistant", "content": "<tool_call>{bad}</tool_call>", "tool_calls": []},
            {"role": "tool", "name": "", "content": "error: the tool call is not valid JSON", "error": True},
            {
                "role": "assistant",
                "content": '<tool_call>{"name": "mul", "arguments": {"a": 17, "b": 23}}</tool_call>',
                "tool_calls": [{"name": "mul", "arguments": {"a": 17, "b": 23}}],
            },
            {"role": "tool", "name": "mul", "content": "391", "error": False},
            {"role": "assistant", "content": "391"},
        ],
    },
}


@dataclass(frozen=True)
class Seeded:
    client: httpx.Client
    db: Engine
    alpha: str  # succeeded, lr 1e-3 seed 0, metrics loss and reward/mean, samples at steps 0 and 5
    beta: str  # succeeded with a loss_diverging warning, lr 2e-3 seed 1
    gamma: str  # failed (a failed status event with its reason, and a cancel_requested event)
    delta: str  # cancelled, tagged "seeded", one multi-turn tool episode's sample

    @property
    def ids(self) -> set[str]:
        return {self.alpha, self.beta, self.gamma, self.delta}


def set_run(db: Engine, run_id: str, **values: Any) -> None:
    with db.begin() as conn:
        conn.execute(update(Run).where(Run.id == uuid.UUID(run_id)).values(**values))


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    home = tmp_path_factory.mktemp("browser-runs")
    with embedded_server(home) as client:
        ds = upload_pairs(client, 16)
        ids = [
            submit_dpo(client, ds, name, 20_000, learning_rate=lr, seed=seed)
            for name, lr, seed in (
                ("alpha", 1e-3, 0),
                ("beta", 2e-3, 1),
                ("gamma", 1e-3, 0),
                ("delta", 1e-3, 0),
            )
        ]
        for run_id in ids:
            assert client.post(f"/v1/runs/{run_id}/cancel").status_code == 200
        for run_id in ids:
            wait_run(client, run_id, lambda r: r["status"] in FINISHED, timeout=60)
        db = create_engine(f"sqlite:///{home / 'rlrun.db'}")
        alpha, beta, gamma, delta = ids
        now = datetime.now(UTC)
        rows = [
            {"run_id": uuid.UUID(r), "key": k, "step": s, "value": f * (s + 1), "logged_at": now}
            for r, f in ((alpha, 1.0), (beta, 2.0))
            for k in ("loss", "reward/mean")
            for s in range(10)
        ]
        with Session(db) as session, session.begin():
            write_points(session, rows)
        set_run(db, alpha, status="succeeded", step=10, total_steps=10, error=None)
        set_run(db, beta, status="succeeded", step=10, total_steps=10, warnings=[WARNING], warning_count=1)
        set_run(db, gamma, status="failed", error=REASON)
        resp = client.patch(f"/v1/runs/{delta}", json={"tags": ["seeded"]})
        assert resp.status_code == 200, resp.text
        with db.begin() as conn:
            for kind, message, data in (
                ("cancel_requested", "cancel requested by the user", None),
                ("status", "failed", {"error": REASON}),
            ):
                conn.execute(
                    insert(Event).values(run_id=uuid.UUID(gamma), kind=kind, message=message, data=data)
                )
            for step, prompt, completion, ref in (
                (0, "What is 2+2?", "5", "4"),
                (0, "What is 3+3?", "6", "6"),
                (5, "What is 7+1?", "eight", "8"),
            ):
                conn.execute(
                    insert(RunSample).values(
                        run_id=uuid.UUID(alpha),
                        step=step,
                        prompt=prompt,
                        completion=completion,
                        reward=1.0 if completion == ref else 0.0,
                        data={"reference": ref},
                    )
                )
            conn.execute(insert(RunSample).values(run_id=uuid.UUID(delta), **TRANSCRIPT_SAMPLE))
        try:
            yield Seeded(client, db, alpha, beta, gamma, delta)
        finally:
            db.dispose()


# ---------- helpers ----------


def row_ids(browser: WebDriver) -> list[str]:
    found: list[str] = browser.execute_script(
        "return [...document.querySelectorAll('[data-testid=run-row]')].map((tr) => tr.dataset.runId);"
    )
    return found


def api_ids(client: httpx.Client, **params: Any) -> list[str]:
    page = client.get("/v1/runs", params={"limit": 50, **params}).json()
    return [r["id"] for r in page["data"]]


def no_horizontal_scroll(browser: WebDriver) -> None:
    sizes = browser.execute_script(
        "const d = document.documentElement; return [d.scrollWidth, d.clientWidth];"
    )
    assert sizes[0] <= sizes[1], sizes


def flatten(obj: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted paths to leaves (lists and empty objects are leaves), as the diff table names fields."""
    out: dict[str, Any] = {}
    for k, v in obj.items():
        path = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v:
            out |= flatten(v, path)
        else:
            out[path] = v
    return out


MISSING = object()


def fields_that_differ(*specs: dict[str, Any]) -> set[str]:
    flat = [flatten(s) for s in specs]
    paths = set().union(*flat)
    return {p for p in paths if len({json.dumps(f.get(p, MISSING), default=id) for f in flat}) > 1}


def shown(value: Any) -> str:
    """A spec value as the dashboard writes it: strings as they are, the rest as compact JSON."""
    if value is MISSING:
        return "—"
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


# WCAG 2.x contrast of an element's text against the first opaque background behind it.
CONTRAST_JS = """
const lum = (c) => {
  const [r, g, b] = c.slice(0, 3)
    .map((v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
  return 0.2126 * r + 0.7152 * g + 0.0722 * b;
};
const rgba = (s) => { const m = s.match(/[\\d.]+/g).map(Number); return m.length === 3 ? [...m, 1] : m; };
const bgOf = (el) => {
  for (let e = el; e; e = e.parentElement) {
    const c = rgba(getComputedStyle(e).backgroundColor);
    if (c[3] >= 0.99) return c;
  }
  return rgba(getComputedStyle(document.documentElement).backgroundColor);
};
return arguments[0].map((css) => [...document.querySelectorAll(css)].slice(0, 5).map((el) => {
  const fg = rgba(getComputedStyle(el).color), bg = bgOf(el);
  const [a, b] = [lum(fg), lum(bg)].sort((x, y) => y - x);
  return [css, el.textContent.trim().slice(0, 30), Math.round(((a + 0.05) / (b + 0.05)) * 100) / 100];
})).flat();
"""

UNNAMED_JS = """
return [...document.querySelectorAll('input, select, textarea')].filter((el) => {
  if (el.type === 'hidden' || el.getAttribute('aria-hidden') === 'true') return false;
  const named = (el.getAttribute('aria-label') || '').trim()
    || (el.getAttribute('aria-labelledby') || '').split(/\\s+/)
      .some((id) => id && document.getElementById(id)?.textContent.trim())
    || [...(el.labels || [])].some((l) => l.textContent.trim()) || (el.title || '').trim();
  return !named;
}).map((el) => el.outerHTML.slice(0, 120));
"""


def expect_refusals(browser: WebDriver, path: str) -> None:
    """The console's errors so far (read, so emptied) are all the browser's note of a 422 from ``path``,
    the answer the test asked for."""
    errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors and all(f"{path} - " in m and "status of 422" in m for m in errors), errors


def set_theme(browser: WebDriver, dark: bool) -> None:
    browser.execute_cdp_cmd(
        "Emulation.setEmulatedMedia",
        {"features": [{"name": "prefers-color-scheme", "value": "dark" if dark else "light"}]},
    )


def assert_contrast(browser: WebDriver, selectors: list[str]) -> None:
    """Every selector's contrast, measured once all are on the page: the runs table re-renders when its
    poll answers, and on a loaded machine one landed between the listing and the measurement (the table's
    cells missing for a moment; seen once in a full-suite run)."""
    seen: list[list[Any]] = []

    def all_present() -> bool:
        seen[:] = browser.execute_script(CONTRAST_JS, selectors)
        return {f[0] for f in seen} == set(selectors)

    try:
        wait(browser, all_present, what="")
    except TimeoutException:
        pass  # the assertion below names what is missing
    found = seen
    assert {f[0] for f in found} == set(selectors), (
        f"not on the page: {set(selectors) - {f[0] for f in found}}"
    )
    low = [f for f in found if f[2] < 4.5]
    assert not low, low


def assert_every_control_named(browser: WebDriver) -> None:
    unnamed: list[str] = browser.execute_script(UNNAMED_JS)
    assert not unnamed, unnamed


# ---------- tests ----------


def test_runs_table_sorts_searches_and_shows_key_metric_and_warnings(
    seeded: Seeded, browser: WebDriver
) -> None:
    browser.set_window_size(WIDTHS["desktop"], 1000)
    everyone = {seeded.alpha, seeded.beta, seeded.gamma, seeded.delta}
    open_page(browser, seeded.client, "/runs")
    wait(browser, lambda: set(row_ids(browser)) == everyone, what="runs not listed")
    assert row_ids(browser) == api_ids(seeded.client)  # newest first
    for sort, aria in (("name", "ascending"), ("-name", "descending")):
        click(browser, '[data-testid="sort-name"]')
        want = api_ids(seeded.client, sort=sort)
        wait(browser, lambda w=want: row_ids(browser) == w, what=f"rows not in the order of sort={sort}")
        head = browser.find_element(By.CSS_SELECTOR, 'th[data-sort="name"]')
        assert head.get_attribute("aria-sort") == aria
    assert "sort=-name" in browser.current_url
    click(browser, '[data-testid="sort-status"]')
    wait(browser, lambda: row_ids(browser) == api_ids(seeded.client, sort="status"), what="status sort")

    search = browser.find_element(By.ID, "runs-search")
    search.send_keys("BET")  # any case
    want = api_ids(seeded.client, q="BET", sort="status")
    assert want == [seeded.beta]
    wait(browser, lambda: row_ids(browser) == want, what="search not applied")
    assert browser.execute_script("return document.activeElement.id") == "runs-search"
    badge = browser.find_element(
        By.CSS_SELECTOR, f'tr[data-run-id="{seeded.beta}"] [data-testid="warning-badge"]'
    )
    assert badge.text == "⚠ loss_diverging"  # a succeeded run visibly flagged, in words
    search.send_keys(Keys.BACKSPACE * 3)  # as typed (clear() sends no input event)
    want = api_ids(seeded.client, sort="status")
    wait(browser, lambda: row_ids(browser) == want, what="search not cleared")
    # the algorithm filter is the API's: none of these runs is sft, all are dpo
    algorithm = Select(browser.find_element(By.ID, "filter-algorithm"))
    algorithm.select_by_value("sft")
    assert api_ids(seeded.client, algorithm="sft", sort="status") == []
    wait(browser, lambda: row_ids(browser) == [], what="algorithm filter not applied")
    assert "algorithm=sft" in browser.current_url
    algorithm.select_by_value("dpo")
    want = api_ids(seeded.client, algorithm="dpo", sort="status")
    wait(browser, lambda: row_ids(browser) == want and len(want) == 4, what="algorithm filter dpo")

    # the key metric per algorithm: reward/mean by default (no eval/pass@1), loss once chosen, remembered
    def cell(run_id: str) -> str:
        found: str = browser.execute_script(
            "const td = document.querySelector(`tr[data-run-id='${arguments[0]}'] [data-testid=key-metric]`);"
            "return td ? td.innerText.trim() : '';",
            run_id,
        )
        return found

    wait(browser, lambda: cell(seeded.beta) == "reward/mean 20", what="default key metric")
    Select(browser.find_element(By.ID, "key-metric-dpo")).select_by_value("loss")
    wait(browser, lambda: cell(seeded.alpha) == "loss 10", what="chosen key metric not shown")
    assert browser.execute_script("return localStorage.getItem('rlrun.keyMetric.dpo')") == "loss"
    browser.refresh()
    wait(browser, lambda: cell(seeded.beta) == "loss 20", what="key metric choice not remembered")
    browser.execute_script("localStorage.clear()")
    # at phone width each run is one wrapped block: nothing scrolls sideways, not even inside the table's card
    browser.set_window_size(WIDTHS["phone"], 1000)
    click(browser, '[data-testid="sort-name"]')
    want = api_ids(seeded.client, algorithm="dpo", sort="name")
    wait(browser, lambda: row_ids(browser) == want, what="sort by name at phone width")
    no_horizontal_scroll(browser)
    inner = browser.execute_script(
        "const t = document.getElementById('runs-table');return [t.scrollWidth, t.parentElement.clientWidth];"
    )
    assert inner[0] <= inner[1], f"the runs table scrolls sideways in its card: {inner}"
    assert_no_console_errors(browser)


def test_tags_edited_on_the_run_page_then_filtered_by(seeded: Seeded, browser: WebDriver) -> None:
    browser.set_window_size(WIDTHS["desktop"], 1000)
    open_page(browser, seeded.client, f"/runs/{seeded.alpha}")
    click(browser, '[data-testid="edit-meta"]')
    tags = browser.find_element(By.ID, "edit-tags")
    tags.clear()
    tags.send_keys("Bad Tag!")
    click(browser, '[data-testid="save-meta"]')
    wait(browser, lambda: "tags" in text(browser, "meta-error"), what="422 not shown with its field")
    expect_refusals(browser, f"/v1/runs/{seeded.alpha}")
    tags = browser.find_element(By.ID, "edit-tags")
    assert tags.get_attribute("value") == "Bad, Tag!"  # what was typed is kept, to be mended
    tags.clear()
    tags.send_keys("baseline, sweep-1")
    browser.find_element(By.ID, "edit-note").send_keys("first try")
    click(browser, '[data-testid="save-meta"]')
    shown_tags = (
        "return [...document.querySelectorAll('[data-testid=run-tags] [data-tag]')].map((a) => a.dataset.tag)"
    )
    wait(browser, lambda: browser.execute_script(shown_tags) == ["baseline", "sweep-1"], what="not saved")
    run = seeded.client.get(f"/v1/runs/{seeded.alpha}").json()
    assert (run["tags"], run["note"]) == (["baseline", "sweep-1"], "first try")
    assert text(browser, "run-note") == "first try"

    open_page(browser, seeded.client, "/runs")
    click(browser, f'tr[data-run-id="{seeded.alpha}"] [data-testid="run-tags"] [data-tag="sweep-1"]')
    want = api_ids(seeded.client, tag="sweep-1")
    assert want == [seeded.alpha]
    wait(browser, lambda: row_ids(browser) == want, what="tag filter not applied")
    assert "tag=sweep-1" in browser.current_url
    click(browser, '[data-testid="tag-filter-chip"]')  # removes it
    want = api_ids(seeded.client)
    wait(browser, lambda: row_ids(browser) == want, what="tag filter not removed")
    assert_no_console_errors(browser)


@pytest.mark.parametrize("width", ["desktop", "phone"])
def test_compare_overlays_metrics_and_diffs_the_specs(seeded: Seeded, browser: WebDriver, width: str) -> None:
    browser.set_window_size(WIDTHS[width], 1000)
    open_page(browser, seeded.client, "/runs")
    for run_id in (seeded.alpha, seeded.beta):
        click(browser, f'tr[data-run-id="{run_id}"] [data-testid="select-run"]')
    assert text(browser, "compare-button") == "Compare 2 runs"
    no_horizontal_scroll(browser)  # the table scrolls inside its card
    click(browser, '[data-testid="compare-button"]')
    wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "figure[data-chart]"), what="no chart")
    click(browser, '[data-testid="compare-metric"][value="loss"]')  # a second metric: a second chart
    charts = ["compare-chart-reward/mean", "compare-chart-loss"]

    def series(testid: str) -> Any:
        return browser.execute_script(
            "const f = document.querySelector(`figure[data-chart='${CSS.escape(arguments[0])}']`);"
            "return f && f._chart.u && [...f.querySelectorAll('.legend-item')].map((e) =>"
            "  [e.dataset.series, Number(e.dataset.points)]);",
            testid,
        )

    want = [[seeded.alpha, 10], [seeded.beta, 10]]
    wait(browser, lambda: all(series(c) == want for c in charts), what="charts without both runs")
    colors = browser.execute_script(
        "return arguments[0].map((id) => document.querySelector(`figure[data-chart='${CSS.escape(id)}']`)"
        "  ._chart.defs.map((d) => d.color));",
        charts,
    )
    assert colors[0] == colors[1] and len(set(colors[0])) == 2  # one colour per run, the same in each chart

    specs = [seeded.client.get(f"/v1/runs/{r}").json()["spec"] for r in (seeded.alpha, seeded.beta)]
    differ = fields_that_differ(*specs)
    assert {"name", "hyperparameters.learning_rate", "hyperparameters.seed"} <= differ
    rows = browser.execute_script(
        "return [...document.querySelectorAll('[data-testid=diff-row]')].map((tr) =>"
        "  [tr.dataset.path, [...tr.cells].slice(1).map((td) => td.innerText)]);"
    )
    assert {p for p, _ in rows} == differ
    flat = [flatten(s) for s in specs]
    for path, cells in rows:
        assert cells == [shown(f.get(path, MISSING)) for f in flat], path
    heads = browser.execute_script(
        "return [...document.querySelectorAll('[data-testid=config-diff] th[data-run-id]')]"
        "  .map((th) => [th.dataset.runId, th.dataset.color]);"
    )
    assert heads == [[seeded.alpha, colors[0][0]], [seeded.beta, colors[0][1]]]
    no_horizontal_scroll(browser)

    # add a third run from the search box; it keeps the first two runs' colours
    browser.find_element(By.CSS_SELECTOR, ".picker summary").click()
    browser.find_element(By.ID, "compare-add").send_keys("delta")
    click(browser, f'[data-testid="compare-add-run"][data-run-id="{seeded.delta}"]')
    wait(browser, lambda: seeded.delta in browser.current_url, what="run not added")
    wait(browser, lambda: series("compare-chart-loss") is not None and len(series("compare-chart-loss")) == 3)
    again = browser.execute_script(
        "return document.querySelector(`figure[data-chart='compare-chart-loss']`)._chart.defs"
        "  .map((d) => d.color);"
    )
    assert again[:2] == colors[0]
    no_horizontal_scroll(browser)
    assert_no_console_errors(browser)


def test_clone_a_run_from_its_spec(seeded: Seeded, browser: WebDriver) -> None:
    browser.set_window_size(WIDTHS["desktop"], 1000)
    open_page(browser, seeded.client, f"/runs/{seeded.beta}")
    wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, '[data-testid="spec"]'), what="no spec")
    row = browser.find_element(
        By.CSS_SELECTOR, '[data-testid="spec"] tr[data-path="hyperparameters.learning_rate"]'
    )
    assert row.text.split() == ["hyperparameters.learning_rate", "0.002"]
    click(browser, '[data-testid="copy-spec"]')
    wait(browser, lambda: text(browser, "copy-status") == "copied", what="spec not copied")
    click(browser, '[data-testid="clone-run"]')
    box = browser.find_element(By.ID, "clone-spec")
    spec = json.loads(box.get_attribute("value"))
    assert spec["name"] == "beta (clone)"

    def submit(edited: dict[str, Any]) -> None:
        box.clear()
        browser.execute_script("arguments[0].value = arguments[1]", box, json.dumps(edited))
        click(browser, '[data-testid="clone-submit"]')

    submit({**spec, "hyperparameters": {**spec["hyperparameters"], "learning_rate": -1}})
    wait(browser, lambda: "learning_rate" in text(browser, "clone-error"), what="422 field not shown")
    expect_refusals(browser, "/v1/runs")
    edited = {**spec, "hyperparameters": {**spec["hyperparameters"], "learning_rate": 5e-4, "max_steps": 3}}
    submit(edited)
    wait(browser, lambda: seeded.beta not in browser.current_url, what="new run not opened")
    new_id = browser.current_url.rsplit("/", 1)[-1]
    try:
        run = seeded.client.get(f"/v1/runs/{new_id}").json()
        assert run["name"] == "beta (clone)"
        assert run["spec"]["hyperparameters"]["learning_rate"] == 5e-4
        assert run["spec"]["hyperparameters"]["max_steps"] == 3
        assert flatten(run["spec"]).keys() >= flatten(edited).keys() - {"name"}
    finally:
        seeded.client.post(f"/v1/runs/{new_id}/cancel")
        wait_run(seeded.client, new_id, lambda r: r["status"] in FINISHED, timeout=60)
    browser.get("about:blank")
    assert_no_console_errors(browser)


@pytest.mark.parametrize("width", ["desktop", "phone"])
def test_failed_event_reason_and_samples(seeded: Seeded, browser: WebDriver, width: str) -> None:
    browser.set_window_size(WIDTHS[width], 1000)
    open_page(browser, seeded.client, f"/runs/{seeded.gamma}")
    failed = wait(
        browser, lambda: browser.find_elements(By.CSS_SELECTOR, "li.event-failed"), what="no failed event"
    )[0]
    assert "failed" in failed.find_element(By.CSS_SELECTOR, ".kind").text.lower()  # in words, not colour only
    reason = failed.find_element(By.CSS_SELECTOR, '[data-testid="event-reason"]')
    assert reason.is_displayed() and REASON in reason.text
    red, bad = browser.execute_script(
        "return [getComputedStyle(arguments[0]).color,"
        " getComputedStyle(document.body).getPropertyValue('--bad').trim()]",
        failed.find_element(By.CSS_SELECTOR, ".kind"),
    )
    probe = browser.execute_script(
        "const s = document.createElement('span'); s.style.color = arguments[0]; document.body.append(s);"
        "const c = getComputedStyle(s).color; s.remove(); return c;",
        bad,
    )
    assert red == probe
    overlap = browser.execute_script(  # the kind label stays in its column
        "const li = document.querySelector('li[data-kind=cancel_requested]');"
        "const k = li.querySelector('.kind'), m = li.querySelector('.msg');"
        "return [k.getBoundingClientRect().right, m.getBoundingClientRect().left,"
        "  k.scrollWidth, k.clientWidth];"
    )
    assert overlap[0] <= overlap[1] and overlap[2] <= overlap[3], overlap
    no_horizontal_scroll(browser)

    open_page(browser, seeded.client, f"/runs/{seeded.alpha}")
    wait(
        browser,
        lambda: browser.find_elements(By.CSS_SELECTOR, '[data-testid="sample-row"]'),
        what="no samples",
    )
    steps = Select(browser.find_element(By.ID, "sample-step"))
    assert steps.first_selected_option.text == "step 5"  # the last step first
    assert [r.text for r in browser.find_elements(By.CSS_SELECTOR, '[data-testid="sample-reference"]')] == [
        "8"
    ]
    click(browser, '[data-testid="sample-prev"]')
    wait(browser, lambda: len(browser.find_elements(By.CSS_SELECTOR, '[data-testid="sample-row"]')) == 2)
    assert Select(browser.find_element(By.ID, "sample-step")).first_selected_option.text == "step 0"
    browser.find_element(By.ID, "sample-search").send_keys("eight")
    wait(browser, lambda: "matching “eight”" in text(browser, "sample-count"), what="search not applied")
    assert browser.execute_script("return document.activeElement.id") == "sample-search"  # typing goes on
    assert Select(browser.find_element(By.ID, "sample-step")).first_selected_option.text == "all steps"
    rows = browser.find_elements(By.CSS_SELECTOR, '[data-testid="sample-row"]')
    api_rows = seeded.client.get(f"/v1/runs/{seeded.alpha}/samples", params={"q": "eight"}).json()["data"]
    assert [r.get_attribute("data-step") for r in rows] == [str(s["step"]) for s in api_rows] == ["5"]
    no_horizontal_scroll(browser)
    assert_no_console_errors(browser)


@pytest.mark.parametrize("width", ["desktop", "phone"])
def test_a_tool_episode_sample_shows_its_turns(seeded: Seeded, browser: WebDriver, width: str) -> None:
    browser.set_window_size(WIDTHS[width], 1000)
    open_page(browser, seeded.client, f"/runs/{seeded.delta}")
    turns = wait(
        browser,
        lambda: browser.find_elements(By.CSS_SELECTOR, '[data-testid="sample-transcript"] > li'),
        what="no transcript",
    )
    assert [t.get_attribute("data-role") for t in turns] == [
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    labels = [t.find_element(By.CSS_SELECTOR, "span").text for t in turns]
    assert labels == ["model", "tool (error)", "model", "tool mul", "model"]  # an error in words
    assert 'calls mul({"a":17,"b":23})' in turns[2].text
    assert turns[3].find_element(By.CSS_SELECTOR, ".text").text == "391"
    details = browser.find_element(By.CSS_SELECTOR, '[data-testid="sample-row"] td:last-child').text
    assert "ended: answer" in details and "transcript" not in details
    no_horizontal_scroll(browser)


def test_contrast_and_accessible_names_in_both_themes(seeded: Seeded, browser: WebDriver) -> None:
    browser.set_window_size(WIDTHS["desktop"], 1000)
    try:
        for dark in (False, True):
            set_theme(browser, dark)
            open_page(browser, seeded.client, "/runs")
            wait(browser, lambda: set(row_ids(browser)) >= seeded.ids, what="runs not listed")
            assert browser.execute_script("return matchMedia('(prefers-color-scheme: dark)').matches") is dark
            click(browser, f'tr[data-run-id="{seeded.alpha}"] [data-testid="select-run"]')  # enables Compare
            assert_contrast(
                browser,
                [
                    ".page-head .muted",
                    ".table th",
                    "button.primary",
                    ".badge.status-succeeded",
                    ".badge.status-failed",
                    ".badge.status-cancelled",
                    ".badge.warn-badge",
                    "td .tag",
                    "td .muted",
                ],
            )
            assert_every_control_named(browser)
            open_page(browser, seeded.client, f"/runs/{seeded.gamma}")
            wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "li.event-failed"), what="events")
            click(browser, '[data-testid="edit-meta"]')
            click(browser, '[data-testid="clone-run"]')
            assert_contrast(
                browser, ["li.event-failed .kind", "li.event-failed .reason", "time", "button.primary"]
            )
            assert_every_control_named(browser)
            open_page(browser, seeded.client, f"/compare?runs={seeded.alpha},{seeded.beta}")
            wait(
                browser, lambda: browser.find_elements(By.CSS_SELECTOR, "[data-testid=diff-row]"), what="diff"
            )
            assert_every_control_named(browser)
    finally:
        set_theme(browser, False)
    assert_no_console_errors(browser)
