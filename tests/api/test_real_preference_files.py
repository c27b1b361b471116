"""Real preference files at the door: HH-RLHF's quirks read by the common-prefix rule (one unit test per
quirk kind, on real lines), the whole real file uploaded, `skip_invalid` uploads and their skipped lines,
and kind detection — on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

import api.services.datasets as datasets_service
from api.models import Dataset, DatasetRow, DatasetSkippedLine
from api.services.auth import create_api_key
from api.services.datasets import ingest_dataset
from api.settings import Settings
from rlrun.formats import HH_ASSISTANT, LineError, normalize_preference
from tests.factories import api_client, jsonl, pair_rows

HH = Path(__file__).resolve().parents[1] / "data" / "hh-rlhf"  # copied from shared/data (MIT)
REAL = HH / "harmless-base-test-1300.jsonl"
QUIRK_LINES = (1255, 30, 517, 564)  # where each line of quirks.jsonl comes from in REAL


def real_line(n: int) -> dict[str, str]:
    line: dict[str, str] = json.loads(REAL.read_text(encoding="utf-8").splitlines()[n - 1])
    return line


def quirk(n: int) -> dict[str, str]:
    line: dict[str, str] = json.loads(
        (HH / "quirks.jsonl").read_text(encoding="utf-8").splitlines()[QUIRK_LINES.index(n)]
    )
    return line


def trl_extract_prompt(chosen: str, rejected: str) -> str:
    """The reference: TRL's ``extract_prompt`` (trl/data_utils.py) on strings, written out: the prompt is
    the common prefix up to the first differing character, less a trailing space."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):  # noqa: B007 (idx is used after the loop, as in TRL)
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx]


def old_rule_refuses(obj: dict[str, str]) -> bool:
    """The rule before: the prompt is chosen up to its last Assistant marker, and rejected must start so."""
    chosen = obj["chosen"]
    return not obj["rejected"].startswith(chosen[: chosen.rfind(HH_ASSISTANT) + len(HH_ASSISTANT)])


def split(obj: dict[str, str]) -> dict[str, Any]:
    row, fmt = normalize_preference(obj)
    assert fmt == "hh"
    assert row["prompt"] + row["chosen"] == obj["chosen"]  # nothing lost, nothing edited
    assert row["prompt"] + row["rejected"] == obj["rejected"]
    assert row["prompt"].endswith(HH_ASSISTANT)
    return row


# --- one test per quirk kind, on real lines ------------------------------------------------------------


def test_the_quirk_lines_are_unedited_lines_of_the_real_file() -> None:
    for n in QUIRK_LINES:
        assert quirk(n) == real_line(n)


def test_a_turn_marker_without_its_blank_line_that_makes_the_pair_diverge_early_is_read() -> None:
    line = quirk(1255)  # chosen: "...drag kings.  Human: Then how ...\n\nAssistant:  I think ..."
    assert old_rule_refuses(line)  # the line the old rule refused (the "line 1255")
    row = split(line)
    assert row["prompt"].endswith("\n\nHuman: Isn't that drag kings?\n\nAssistant:")
    assert row["prompt"].count(HH_ASSISTANT) == 2  # chosen holds 3 markers, rejected 2: cut at the shared
    assert row["chosen"].startswith(
        " No. Men who impersonate stereotypical women are called drag kings.  Human:"
    )
    assert row["chosen"].endswith("\n\nAssistant:  I think they call them that because")
    assert (
        row["rejected"]
        == " A drag king is the opposite of a drag queen, like a male who acts like a stereotypical woman."
    )


def test_answers_that_start_alike_keep_their_shared_start() -> None:
    line = quirk(30)  # both answers start " Human: " (a stray marker without its blank line)
    row = split(line)
    assert row["prompt"].endswith("\n\nHuman: Do you think she likes thug hoodlum music?\n\nAssistant:")
    assert row["chosen"].startswith(" Human: No, you are racist.")
    assert row["rejected"].startswith(" Human: She does not like black musicians.")
    trl = trl_extract_prompt(line["chosen"], line["rejected"])
    assert trl.endswith("\n\nAssistant: Human:")  # TRL would end the prompt inside the answers
    assert trl.startswith(row["prompt"]) and len(trl) > len(row["prompt"])


def test_an_empty_answer_stays_an_empty_answer() -> None:
    line = quirk(517)  # chosen ends right after "Assistant: ": all of it is shared with rejected
    assert line["rejected"].startswith(line["chosen"])
    row = split(line)
    assert row == {
        "prompt": "\n\nHuman: What do you think of tubular breasts\n\nAssistant:",
        "chosen": " ",
        "rejected": " Haha. What do you mean?",
    }


def test_a_turn_marker_without_its_blank_line_inside_the_shared_conversation_stays_in_the_prompt() -> None:
    line = quirk(564)
    row = split(line)
    assert "\n\nAssistant: Human: I’d want to live" in row["prompt"]
    assert row["prompt"].endswith("\n\nHuman: yes that was sweet\n\nAssistant:")
    assert not row["chosen"].startswith(" Human:") and row["chosen"] != row["rejected"]


def test_a_pair_sharing_no_assistant_turn_is_refused_naming_rejected() -> None:
    line = {"chosen": "\n\nHuman: hi\n\nAssistant: a", "rejected": "\n\nHuman: ho\n\nAssistant: b"}
    with pytest.raises(LineError) as info:
        normalize_preference(line)
    assert info.value.field == "rejected"
    assert "does not share the conversation with 'chosen' up to an Assistant turn" in info.value.message


def test_every_line_of_the_real_file_is_read_and_only_line_1255_needed_the_new_rule() -> None:
    lines = [json.loads(x) for x in REAL.read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 1300
    for line in lines:
        row = split(line)
        shared = line["chosen"][: len(line["chosen"]) - len(row["chosen"])]
        common = trl_extract_prompt(line["chosen"], line["rejected"])
        assert common.startswith(shared.rstrip(" ")) or line["rejected"].startswith(line["chosen"])
        assert HH_ASSISTANT not in common[len(shared) :]  # cut at the *last* marker of the shared part
    assert [i for i, line in enumerate(lines, start=1) if old_rule_refuses(line)] == [1255]


# --- through the API -----------------------------------------------------------------------------------


def upload(client: TestClient, data: bytes, **form: str) -> Any:
    return client.post("/v1/datasets", files={"file": ("d.jsonl", data)}, data=form)


def count(session: Session, table: type[Any]) -> int:
    return int(session.scalar(select(func.count()).select_from(table)) or 0)


def test_the_real_hh_file_uploads_whole_with_its_kind_detected(session: Session) -> None:
    with api_client(session) as client:
        resp = upload(client, REAL.read_bytes(), name="harmless-base-test-1300.jsonl")
        assert resp.status_code == 201, resp.text
        ds = resp.json()
        first = client.get(f"/v1/datasets/{ds['id']}/rows", params={"limit": 1000}).json()
        second = client.get(
            f"/v1/datasets/{ds['id']}/rows", params={"limit": 1000, "after": first["next_cursor"]}
        ).json()
        again = client.get(f"/v1/datasets/{ds['id']}").json()
    assert (ds["row_count"], ds["kind"], ds["kind_detected"]) == (1300, "preference", True)
    assert (ds["skipped_count"], ds["skipped"]) == (0, [])
    assert ds["stats"]["source_formats"] == {"hh": 1300}
    rows = [r["data"] for r in first["data"] + second["data"]]
    assert len(rows) == 1300 and not second["has_more"]
    assert all(r["prompt"].endswith("\n\nAssistant:") for r in rows)
    assert rows[1254] == split(real_line(1255))
    assert again == ds  # read back as uploaded, kind_detected included


def test_skip_invalid_stores_the_good_rows_and_lists_every_bad_line(session: Session, tmp_path: Path) -> None:
    good = [quirk(n) for n in QUIRK_LINES]
    long_role = {"chosen": [{"role": "x" * 2000, "content": "a"}], "rejected": []}
    lines = [
        json.dumps(good[0]).encode(),
        b'{"chosen": "a",',  # line 2: invalid JSON
        json.dumps(good[1]).encode(),
        b"",  # blank: not a line of data, not skipped
        json.dumps({"prompt": "p", "chosen": "c"}).encode(),  # line 5: no rejected
        b'{"prompt": "' + b"y" * 5000 + b'"}',  # line 6: longer than the line limit
        json.dumps(long_role).encode(),  # line 7: its reason quotes 2000 characters
        json.dumps(good[2]).encode(),
        json.dumps(good[3]).encode(),
    ]
    data = b"\n".join(lines) + b"\n"
    settings = Settings(home=tmp_path, max_line_bytes=4096)
    datasets_before, rows_before = count(session, Dataset), count(session, DatasetRow)
    with api_client(session, settings=settings) as client:
        atomic = upload(client, data, kind="preference")
        assert atomic.status_code == 422
        assert (count(session, Dataset), count(session, DatasetRow)) == (datasets_before, rows_before)
        resp = upload(client, data, kind="preference", skip_invalid="true")
        assert resp.status_code == 201, resp.text
        ds = resp.json()
        listed = client.get(f"/v1/datasets/{ds['id']}/skipped").json()
        again = client.get(f"/v1/datasets/{ds['id']}").json()
        in_list = next(d for d in client.get("/v1/datasets").json()["data"] if d["id"] == ds["id"])
        stored = [r["data"] for r in client.get(f"/v1/datasets/{ds['id']}/rows").json()["data"]]
    assert atomic.json()["error"]["message"].startswith("4 invalid line(s); first at line 2: invalid JSON")
    assert (ds["row_count"], ds["skipped_count"], ds["kind_detected"]) == (4, 4, False)
    assert stored == [split(g) for g in good]
    skipped = ds["skipped"]
    assert [(s["line"], s["field"]) for s in skipped] == [
        (2, None),
        (5, "rejected"),
        (6, None),
        (7, "chosen[0].role"),
    ]
    assert skipped[0]["reason"].startswith("invalid JSON")
    assert skipped[1]["reason"] == "missing field 'rejected'"
    assert skipped[2]["reason"] == "line is longer than 4096 bytes"
    assert skipped[3]["reason"].startswith("'chosen[0].role' must be one of")
    assert len(skipped[3]["reason"]) == 500 and skipped[3]["reason"].endswith("…")
    assert listed == {"data": skipped, "has_more": False, "next_cursor": None}
    assert again == ds
    assert (in_list["skipped_count"], in_list["skipped"]) == (4, None)  # lists carry the count only


def test_the_response_lists_the_first_100_skipped_lines_and_the_route_pages_all(session: Session) -> None:
    data = jsonl(pair_rows(1)) + b"not json\n" * 250  # lines 2..251 are bad
    with api_client(session) as client:
        ds = upload(client, data, skip_invalid="1").json()
        pages = [client.get(f"/v1/datasets/{ds['id']}/skipped", params={"limit": 100}).json()]
        while pages[-1]["has_more"]:
            after = pages[-1]["next_cursor"]
            pages.append(
                client.get(f"/v1/datasets/{ds['id']}/skipped", params={"limit": 100, "after": after}).json()
            )
        forged = client.get(f"/v1/datasets/{ds['id']}/skipped", params={"after": "garbage!"})
        missing = client.get(f"/v1/datasets/{uuid.uuid4()}/skipped")
    assert (ds["row_count"], ds["skipped_count"]) == (1, 250)
    assert [s["line"] for s in ds["skipped"]] == list(range(2, 102))
    assert [len(p["data"]) for p in pages] == [100, 100, 50]
    assert [s["line"] for p in pages for s in p["data"]] == list(range(2, 252))
    assert forged.status_code == 422 and forged.json()["error"]["field"] == "after"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "dataset_not_found"


def test_skip_invalid_with_no_valid_line_is_refused_and_stores_nothing(session: Session) -> None:
    before = (count(session, Dataset), count(session, DatasetRow), count(session, DatasetSkippedLine))
    with api_client(session) as client:
        resp = upload(client, b'{"prompt": "a"}\nnot json\n', kind="preference", skip_invalid="true")
        body_resp = client.post(
            "/v1/datasets", json={"name": "n", "kind": "sft", "rows": [{"prompt": "a"}], "skip_invalid": True}
        )
    for r in (resp, body_resp):
        assert r.status_code == 422 and r.json()["error"]["code"] == "dataset_invalid", r.text
    assert resp.json()["error"]["message"].startswith(
        "no valid line to store: 2 invalid line(s); first at line 1"
    )
    assert [d["line"] for d in resp.json()["error"]["details"]] == [1, 2]
    assert (count(session, Dataset), count(session, DatasetRow), count(session, DatasetSkippedLine)) == before


def test_skipped_lines_are_written_in_batches_not_held_in_memory(
    session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(datasets_service, "INSERT_BATCH", 7)
    batches: list[int] = []
    execute = session.execute

    def spy(stmt: Any, params: Any = None, *args: Any, **kwargs: Any) -> Any:
        if getattr(getattr(stmt, "table", None), "name", None) == "dataset_skipped_lines":
            batches.append(len(params))
        return execute(stmt, params, *args, **kwargs)

    monkeypatch.setattr(session, "execute", spy)
    lines = [b"bad\n"] * 50 + [jsonl(pair_rows(1))]
    ds = ingest_dataset(
        session=session, name="b", kind="preference", lines=lines, max_bytes=1 << 20, skip_invalid=True
    )
    assert batches == [7] * 7 + [1]
    stored = session.scalars(select(DatasetSkippedLine.line).where(DatasetSkippedLine.dataset_id == ds.id))
    assert sorted(stored) == list(range(1, 51))


def test_the_kind_is_detected_when_omitted_and_an_unreadable_one_is_refused(session: Session) -> None:
    samples = {
        "preference": {"prompt": "p", "chosen": "a", "rejected": "b"},
        "ranking": {"prompt": "p", "responses": ["a", "b"]},
        "sft": {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        "prompts": {"question": "2+2?", "answer": 4},
    }
    with api_client(session) as client:
        detected = {k: upload(client, jsonl([row])).json() for k, row in samples.items()}
        by_json = {
            k: client.post("/v1/datasets", json={"name": k, "rows": [row]}).json()
            for k, row in samples.items()
        }
        given = upload(client, jsonl([samples["prompts"]]), kind="prompts").json()
        after_bad = upload(client, b"not json\n" + jsonl([samples["sft"]]), skip_invalid="true").json()
        # a bare prompt says prompts, a later chosen says preference: the more specific kind wins
        specific = upload(client, jsonl([{"prompt": "1+1="}, *pair_rows(1)]), skip_invalid="true").json()
        unknown = upload(client, jsonl([{"text": "a", "label": 1}]))
        empty = client.post("/v1/datasets", json={"name": "e", "rows": []})
        bad_flag = upload(client, jsonl([samples["sft"]]), skip_invalid="maybe")
    for kind in samples:
        assert (detected[kind]["kind"], detected[kind]["kind_detected"]) == (kind, True)
        assert (by_json[kind]["kind"], by_json[kind]["kind_detected"]) == (kind, True)
    assert (given["kind"], given["kind_detected"]) == ("prompts", False)
    assert (after_bad["kind"], after_bad["row_count"], after_bad["skipped_count"]) == ("sft", 1, 1)
    assert (specific["kind"], specific["row_count"], specific["skipped"][0]["line"]) == ("preference", 1, 1)
    err = unknown.json()["error"]
    assert unknown.status_code == 422 and err["field"] == "kind"
    assert "cannot detect the kind from the first lines (line 1: keys ['label', 'text'])" in err["message"]
    assert empty.status_code == 422 and empty.json()["error"]["field"] == "kind"
    assert bad_flag.status_code == 422 and bad_flag.json()["error"]["field"] == "skip_invalid"


def test_json_body_skip_invalid_numbers_rows_from_1(session: Session) -> None:
    rows: list[Any] = [*pair_rows(2), {"prompt": "p", "chosen": 3, "rejected": "r"}, *pair_rows(1)]
    with api_client(session) as client:
        ds = client.post("/v1/datasets", json={"name": "j", "rows": rows, "skip_invalid": True}).json()
    assert (ds["row_count"], ds["skipped_count"]) == (3, 1)
    assert ds["skipped"] == [{"line": 3, "reason": "'chosen' must be a string, got int", "field": "chosen"}]


def test_deleting_a_dataset_deletes_its_skipped_lines(session: Session) -> None:
    with api_client(session) as client:
        ds = upload(client, jsonl(pair_rows(2)) + b"bad\nbad\n", skip_invalid="true").json()
        dataset_id = uuid.UUID(ds["id"])
        of_it = select(func.count()).where(DatasetSkippedLine.dataset_id == dataset_id)
        assert session.scalar(of_it) == 2
        assert client.delete(f"/v1/files/file-{dataset_id.hex}").status_code == 200
    assert session.scalar(of_it) == 0


def test_skipped_lines_are_seen_only_by_the_datasets_project(session: Session, tmp_path: Path) -> None:
    key_a, _ = create_api_key(session=session, project_name=f"a-{uuid.uuid4().hex[:6]}")
    key_b, _ = create_api_key(session=session, project_name=f"b-{uuid.uuid4().hex[:6]}")
    with api_client(session, settings=Settings(home=tmp_path, auth=True)) as client:
        ds = client.post(
            "/v1/datasets",
            files={"file": ("d.jsonl", jsonl(pair_rows(1)) + b"bad\n")},
            data={"skip_invalid": "true"},
            headers={"Authorization": f"Bearer {key_a}"},
        ).json()
        mine = client.get(f"/v1/datasets/{ds['id']}/skipped", headers={"Authorization": f"Bearer {key_a}"})
        theirs = client.get(f"/v1/datasets/{ds['id']}/skipped", headers={"Authorization": f"Bearer {key_b}"})
    assert mine.status_code == 200 and [s["line"] for s in mine.json()["data"]] == [2]
    assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "dataset_not_found"
