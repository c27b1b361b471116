"""The runs table's server side: sort, search and tag filters with cursor paging; tags and a note per run
(PATCH /v1/runs/{id}). Expected orders and matches are computed here from the rows the test made."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import httpx
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from api.metric_store import write_points
from api.models import Run, RunSample, utcnow
from rlrun.client import Client
from tests.factories import api_client, dpo_spec, make_dataset, make_run

STATUSES = ["succeeded", "failed", "queued", "running", "cancelled", "succeeded"]
ALGORITHMS = ["dpo", "sft", "grpo", "dpo", "reward_model", "grpo"]


def make_table(session: Session, token: str) -> list[Run]:
    ds = make_dataset(session)
    start = utcnow() - timedelta(hours=1)
    runs = []
    for i, (status, algorithm) in enumerate(zip(STATUSES, ALGORITHMS, strict=True)):
        spec = dpo_spec(ds.id) | {"name": f"{token}-{'CBAFED'[i]}run"}
        runs.append(
            make_run(
                session,
                ds,
                spec=spec,
                status=status,
                algorithm=algorithm,
                created_at=start + timedelta(minutes=i),
            )
        )
    return runs


def all_pages(client: TestClient, params: dict[str, Any], limit: int = 2) -> list[dict[str, Any]]:
    """Every page of GET /v1/runs, following next_cursor."""
    out: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = client.get(
            "/v1/runs", params=params | {"limit": limit} | ({"after": cursor} if cursor else {})
        )
        assert page.status_code == 200, page.text
        body = page.json()
        out += body["data"]
        if not body["has_more"]:
            return out
        cursor = body["next_cursor"]


def test_sort_every_column_both_ways_across_pages(session: Session) -> None:
    token = uuid.uuid4().hex[:10]
    runs = make_table(session, token)
    with api_client(session) as client:
        for column in ("created_at", "name", "status", "algorithm"):
            for desc in (False, True):
                sort = f"{'-' if desc else ''}{column}"
                got = [r["id"] for r in all_pages(client, {"sort": sort, "q": token})]
                value = {
                    "created_at": lambda r: r.created_at,
                    "name": lambda r: r.spec["name"],
                    "status": lambda r: r.status,
                    "algorithm": lambda r: r.algorithm,
                }[column]
                expected = sorted(runs, key=lambda r: (value(r), r.created_at, r.id.hex), reverse=desc)
                assert got == [str(r.id) for r in expected], sort
        default = [r["id"] for r in all_pages(client, {"q": token})]
        grpo = [r["id"] for r in all_pages(client, {"q": token, "algorithm": "grpo"})]
        bad = client.get("/v1/runs", params={"sort": "loss"})
        bad_algorithm = client.get("/v1/runs", params={"algorithm": "nope"})
    assert default == [str(r.id) for r in sorted(runs, key=lambda r: r.created_at, reverse=True)]
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "sort"
    newest_first = sorted(runs, key=lambda r: r.created_at, reverse=True)
    assert grpo == [str(r.id) for r in newest_first if r.algorithm == "grpo"] and len(grpo) == 2
    assert bad_algorithm.status_code == 422 and bad_algorithm.json()["error"]["field"] == "algorithm"


def test_tags_and_note_by_patch_then_filter_and_search(session: Session) -> None:
    token = uuid.uuid4().hex[:10]
    runs = make_table(session, token)
    a, b, c = runs[0], runs[1], runs[2]
    with api_client(session) as client:
        set_a = client.patch(f"/v1/runs/{a.id}", json={"tags": ["Baseline", "lr:1e-5", "baseline"]})
        set_b = client.patch(
            f"/v1/runs/{b.id}", json={"tags": ["baseline", "sweep_1"], "note": "Odd dip at 300"}
        )
        note_only = client.patch(f"/v1/runs/{a.id}", json={"note": "keep"})
        # `_` and `%` are LIKE wildcards: a tag must match whole, literally
        wild = client.patch(f"/v1/runs/{c.id}", json={"tags": ["sweepx1"]})
        baseline = all_pages(client, {"q": token, "tag": "baseline"})
        both = all_pages(client, {"q": token, "tag": ["baseline", "sweep_1"]})
        literal = all_pages(client, {"q": token, "tag": "sweep_1"})
        part = all_pages(client, {"q": token, "tag": "base"})
        by_note = all_pages(client, {"q": "ODD DIP"})
        by_tag_text = all_pages(client, {"q": "lr:1e-5"})
        by_id = all_pages(client, {"q": str(b.id)[:8]})
        by_name = all_pages(client, {"q": f"{token}-crun".upper()})
        cleared = client.patch(f"/v1/runs/{b.id}", json={"tags": [], "note": None})
        refused = [
            client.patch(f"/v1/runs/{a.id}", json=body)
            for body in (
                {"tags": ["has space"]},
                {"tags": ["x" * 41]},
                {"tags": [f"t{i}" for i in range(21)]},
                {"note": "n" * 4001},
                {"status": "succeeded"},
                {"tags": "baseline"},
            )
        ]
        after_refusals = client.get(f"/v1/runs/{a.id}").json()
        missing = client.patch(f"/v1/runs/{uuid.uuid4()}", json={"note": "x"})
    assert set_a.status_code == 200 and set_a.json()["tags"] == ["baseline", "lr:1e-5"]
    assert set_b.json()["tags"] == ["baseline", "sweep_1"] and set_b.json()["note"] == "Odd dip at 300"
    assert note_only.json()["tags"] == ["baseline", "lr:1e-5"] and note_only.json()["note"] == "keep"
    assert wild.status_code == 200
    assert {r["id"] for r in baseline} == {str(a.id), str(b.id)}
    assert [r["id"] for r in both] == [str(b.id)]
    assert [r["id"] for r in literal] == [str(b.id)]  # not sweepx1
    assert part == []
    assert [r["id"] for r in by_note] == [str(b.id)]
    assert [r["id"] for r in by_tag_text] == [str(a.id)]
    assert str(b.id) in {r["id"] for r in by_id}
    assert [r["id"] for r in by_name] == [str(runs[0].id)]  # 'C' is the first run's letter
    assert cleared.json()["tags"] == [] and cleared.json()["note"] is None
    fields = [r.json()["error"].get("field", "") for r in refused]
    assert all(r.status_code == 422 for r in refused)
    assert fields[0].startswith("tags") and fields[1].startswith("tags") and fields[2] == "tags"
    assert fields[3] == "note" and fields[5] == "tags"
    assert after_refusals["tags"] == ["baseline", "lr:1e-5"] and after_refusals["note"] == "keep"
    assert missing.status_code == 404


def test_name_column_follows_the_spec_at_submit(session: Session) -> None:
    ds = make_dataset(session)
    named = make_run(session, ds, spec=dpo_spec(ds.id) | {"name": "my sweep"})
    unnamed = make_run(session, ds)
    assert named.name == "my sweep" and unnamed.name == ""


class ViaTestClient(httpx.BaseTransport):
    """The SDK's requests answered by the app in process (through the test's session)."""

    def __init__(self, tc: TestClient):
        self.tc = tc

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        answer = self.tc.request(
            request.method, str(request.url), content=request.read(), headers=dict(request.headers)
        )
        headers = {k: v for k, v in answer.headers.items() if k not in ("content-encoding", "content-length")}
        return httpx.Response(answer.status_code, headers=headers, content=answer.content)


def test_the_sdk_sorts_searches_tags_and_notes(session: Session) -> None:
    token = uuid.uuid4().hex[:10]
    runs = make_table(session, token)
    with api_client(session) as tc, Client("http://testserver", transport=ViaTestClient(tc)) as sdk:
        tagged = sdk.runs.update(runs[3].id, tags=["keep", "Best"])
        noted = sdk.runs.update(runs[3].id, note="the one")
        unnoted = sdk.runs.update(runs[4].id, note=None)
        by_name = [r.id for r in sdk.runs.iter(q=token, sort="name", page_size=4)]
        with_tag = sdk.runs.list(q=token, tags=["best", "keep"]).data
        sft = [r.id for r in sdk.runs.iter(q=token, algorithm="sft")]
    assert tagged.tags == ["keep", "best"] and noted.tags == ["keep", "best"] and noted.note == "the one"
    assert unnoted.note is None
    assert by_name == [r.id for r in sorted(runs, key=lambda r: r.spec["name"])]
    assert [r.id for r in with_tag] == [runs[3].id]
    assert sft == [r.id for r in runs if r.algorithm == "sft"]


def test_samples_are_searched_across_steps(session: Session) -> None:
    run = make_run(session, make_dataset(session))
    texts = [
        (1, "What is 2+2?", "It is 4"),
        (5, "what is 3+3?", "6, I think"),
        (9, "Name a colour", "50%_red"),
    ]
    for step, prompt, completion in texts:
        session.add(
            RunSample(
                run_id=run.id,
                step=step,
                prompt=prompt,
                completion=completion,
                reward=1.0,
                data={"reference": "x"},
            )
        )
    session.flush()
    with api_client(session) as client:

        def found(**params: Any) -> list[int]:
            answer = client.get(f"/v1/runs/{run.id}/samples", params=params)
            assert answer.status_code == 200, answer.text
            return [s["step"] for s in answer.json()["data"]]

        what = found(q="WHAT IS")
        think = found(q="think")
        literal = found(q="0%_r")  # LIKE wildcards match literally
        wildcard = found(q="%")
        with_step = found(q="what", step=5)
        empty = client.get(f"/v1/runs/{run.id}/samples", params={"q": ""})
    assert what == [1, 5] and think == [5] and literal == [9] and wildcard == [9] and with_step == [5]
    assert empty.status_code == 422 and empty.json()["error"]["field"] == "q"


def test_last_metrics_of_many_runs_in_one_request(session: Session) -> None:
    ds = make_dataset(session)
    a, b, empty = make_run(session, ds), make_run(session, ds), make_run(session, ds)
    now = utcnow()
    series = {a.id: {"loss": [3.0, 2.0, 1.5], "reward/mean": [0.1, 0.4]}, b.id: {"loss": [9.0]}}
    write_points(
        session,
        [
            {"run_id": run_id, "key": key, "step": 10 * (i + 1), "value": v, "logged_at": now}
            for run_id, keys in series.items()
            for key, values in keys.items()
            for i, v in enumerate(values)
        ],
    )
    other_project = uuid.uuid4()  # a run the caller's project cannot see
    with api_client(session) as client:
        got = client.get(
            "/v1/metrics/last",
            params={
                "run": [str(a.id), str(b.id), str(empty.id), str(other_project)],
                "key": ["loss", "reward/mean"],
            },
        )
        no_keys = client.get("/v1/metrics/last", params={"run": str(a.id)})
        bad_id = client.get("/v1/metrics/last", params={"run": "nope", "key": "loss"})
    assert got.status_code == 200, got.text
    assert got.json() == {
        str(a.id): {"loss": {"step": 30, "value": 1.5}, "reward/mean": {"step": 20, "value": 0.4}},
        str(b.id): {"loss": {"step": 10, "value": 9.0}},
        str(empty.id): {},
    }
    assert no_keys.status_code == 422 and no_keys.json()["error"]["field"] == "key"
    assert bad_id.status_code == 422 and bad_id.json()["error"]["field"].startswith("run")
