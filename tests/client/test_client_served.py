"""`rlrun.Client` against a real `rlrun serve` (API + one Celery worker, SQLite + SQL broker): every call
returns the server's own pydantic models, errors carry the API's code and field. (The API key is proven
against a real server in test_cli_served.py, which serves with auth on.)"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlrun import ApiError, Client, WaitTimeout
from rlrun.demo import addition_pairs
from rlrun.schemas import CheckpointRead, DatasetRead, EventRead, MetricRead, PipelineRead, RunRead
from tests.client.helpers import dpo
from tests.factories import jsonl
from tests.integration.flow import embedded_server

pytestmark = [pytest.mark.slow]
LONG = 1_000_000  # steps: a run that only ends by being cancelled


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with embedded_server(tmp_path_factory.mktemp("client")) as http:
        yield str(http.base_url)


@pytest.fixture(scope="module")
def rl(served: str) -> Iterator[Client]:
    with Client(served) as client:
        yield client


@pytest.fixture(scope="module")
def dpo_run(rl: Client, pairs: DatasetRead) -> RunRead:
    run = rl.runs.create(dpo(pairs.id, 10), idempotency_key="dpo-10")
    return rl.runs.wait(run.id, timeout=120, interval=0.2)


def test_upload_streams_the_file_reports_progress_and_reads_back(rl: Client, tmp_path: Path) -> None:
    rows = addition_pairs(2000, seed=1)
    path = tmp_path / "many.jsonl"
    path.write_bytes(jsonl(rows))
    size = path.stat().st_size
    seen: list[tuple[int, int]] = []
    ds = rl.datasets.upload(
        path, kind="preference", name="adds", progress=lambda s, t: seen.append((s, t)), chunk_size=4096
    )
    assert isinstance(ds, DatasetRead)
    assert (ds.name, ds.kind, ds.row_count, ds.stats.rows) == ("adds", "preference", 2000, 2000)
    assert seen[0] == (0, size) and seen[-1] == (size, size)
    assert len(seen) == 1 + math.ceil(size / 4096)
    assert [s for s, _ in seen] == sorted(s for s, _ in seen)
    assert rl.datasets.get(ds.id) == ds
    assert ds.id in [d.id for d in rl.datasets.list(limit=200).data]
    first = rl.datasets.rows(ds.id, limit=3)
    assert [r.data for r in first.data] == rows[:3] and first.has_more
    assert rl.datasets.rows(ds.id, limit=3, after=first.next_cursor).data[0].index == 3
    accented = tmp_path / "données ünïcode.jsonl"
    accented.write_bytes(jsonl(rows[:2]))
    assert rl.datasets.upload(accented).name == "données ünïcode.jsonl"  # non-ASCII names survive


def test_a_dpo_run_end_to_end_with_typed_answers(rl: Client, dpo_run: RunRead) -> None:
    assert isinstance(dpo_run, RunRead)
    assert (dpo_run.status, dpo_run.progress.step, dpo_run.progress.total_steps) == ("succeeded", 10, 10)
    keys = rl.runs.metric_keys(dpo_run.id)
    assert {"loss", "rewards/accuracy", "final/loss"} <= set(keys)
    loss = rl.runs.metrics(dpo_run.id, keys=["loss"]).data
    assert all(isinstance(m, MetricRead) and m.key == "loss" for m in loss)
    assert [m.step for m in loss] == list(range(1, 11))
    chart = rl.runs.metrics(dpo_run.id, keys=["loss", "rewards/accuracy"], max_points=4).data
    for key in ("loss", "rewards/accuracy"):
        steps = [m.step for m in chart if m.key == key]
        assert len(steps) <= 4 and min(steps) == 1 and max(steps) == 10  # first and last kept
    events = rl.runs.events(dpo_run.id).data
    assert all(isinstance(e, EventRead) for e in events)
    assert [e.message for e in events if e.kind == "status"] == ["queued", "running", "succeeded"]
    (ckpt,) = rl.runs.checkpoints(dpo_run.id)
    assert isinstance(ckpt, CheckpointRead)
    assert (ckpt.step, ckpt.model_ref) == (10, f"run:{dpo_run.id}@10")
    assert rl.runs.samples(dpo_run.id).data == []  # DPO stores no samples


def test_download_exports_a_folder_from_pretrained_loads(
    rl: Client, dpo_run: RunRead, tmp_path: Path
) -> None:
    import tarfile

    from transformers import AutoModelForCausalLM

    seen: list[tuple[int, int]] = []
    target = tmp_path / "model.tar"
    written = rl.runs.download(dpo_run.id, target, progress=lambda done, total: seen.append((done, total)))
    assert written == target.stat().st_size == seen[-1][0] == seen[-1][1]  # Content-Length was exact
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and not (tmp_path / "model.tar.part").exists()
    with tarfile.open(target) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "out", filter="data")
    folder = tmp_path / "out" / f"{dpo_run.id}-hf"
    assert "config.json" in {Path(n).name for n in names}
    assert not (folder / "trainer_state.pt").exists()  # resume-only files stay on the server
    card = (folder / "README.md").read_text()  # the model card: what produced it
    assert (
        f"run `{dpo_run.id}`" in card and "algorithm `dpo`" in card and "library_name: transformers" in card
    )
    assert f"| training | `{dpo_run.dataset_id}` |" in card and "## Final metrics" in card
    model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True)
    assert sum(p.numel() for p in model.parameters()) > 0
    with pytest.raises(ApiError) as not_adapter:
        rl.runs.download(dpo_run.id, tmp_path / "a.tar", format="adapter")
    assert (not_adapter.value.status, not_adapter.value.field) == (409, "format")
    assert not (tmp_path / "a.tar").exists() and not (tmp_path / "a.tar.part").exists()


def test_idempotency_key_returns_the_same_run(rl: Client, pairs: DatasetRead, dpo_run: RunRead) -> None:
    assert rl.runs.create(dpo(pairs.id, 10), idempotency_key="dpo-10").id == dpo_run.id
    with pytest.raises(ApiError) as info:
        rl.runs.create(dpo(pairs.id, 11), idempotency_key="dpo-10")
    assert (info.value.status, info.value.code) == (409, "idempotency_conflict")


def test_errors_carry_the_api_code_message_and_field(rl: Client, pairs: DatasetRead) -> None:
    with pytest.raises(ApiError) as info:
        rl.runs.create(dpo(pairs.id, 10, learning_rate=-1e-3))
    err = info.value
    assert (err.status, err.code, err.field) == (422, "validation_error", "hyperparameters.learning_rate")
    assert "greater than 0" in err.message
    with pytest.raises(ApiError) as info:
        rl.runs.get(uuid.uuid4())
    assert (info.value.status, info.value.code) == (404, "run_not_found")


def test_cancel_runs_and_list_every_page(rl: Client, pairs: DatasetRead) -> None:
    a, b = (rl.runs.create(dpo(pairs.id, LONG)) for _ in range(2))
    with pytest.raises(WaitTimeout):
        rl.runs.wait(a.id, timeout=0.2, interval=0.1)
    for run in (a, b):
        cancelled = rl.runs.cancel(run.id)
        assert cancelled.status == "cancelled" or cancelled.cancel_requested
    assert [rl.runs.wait(r.id, timeout=60, interval=0.2).status for r in (a, b)] == ["cancelled"] * 2
    one_by_one = [r.id for r in rl.runs.iter(page_size=1)]
    assert one_by_one == [r.id for r in rl.runs.list(limit=200).data]
    assert one_by_one[:2] == [b.id, a.id]  # newest first
    assert {a.id, b.id} <= {r.id for r in rl.runs.iter(status="cancelled", page_size=1)}
    assert all(r.status == "cancelled" for r in rl.runs.iter(status="cancelled"))


def until(rl: Client, run_id: uuid.UUID, status: str, timeout: float = 60) -> RunRead:
    deadline = time.monotonic() + timeout
    while (run := rl.runs.get(run_id)).status != status:
        assert time.monotonic() < deadline, run
        time.sleep(0.2)
    return run


def test_pause_resume_then_cancel(rl: Client, pairs: DatasetRead) -> None:
    run = rl.runs.create(dpo(pairs.id, LONG))
    paused = rl.runs.pause(run.id)
    assert paused.status == "paused" or paused.pause_requested
    until(rl, run.id, "paused")
    assert rl.runs.resume(run.id).status == "queued"
    rl.runs.cancel(run.id)
    assert rl.runs.wait(run.id, timeout=60, interval=0.2).status == "cancelled"


def test_stream_yields_the_runs_events_metrics_and_end(rl: Client, dpo_run: RunRead) -> None:
    messages = list(rl.runs.stream(dpo_run.id, poll_seconds=0.1))
    kinds = [m.event for m in messages]
    assert {"event", "metrics", "status"} <= set(kinds) and kinds[-1] == "end"
    assert messages[-1].data == {"status": "succeeded"}
    events = [m.data["message"] for m in messages if m.event == "event" and m.data["kind"] == "status"]
    assert events == ["queued", "running", "succeeded"]
    loss_steps = sorted(
        p["step"] for m in messages if m.event == "metrics" for p in m.data if p["key"] == "loss"
    )
    assert loss_steps == list(range(1, 11))
    assert all(m.id for m in messages)
    # Resuming after the last status message (Last-Event-ID) sends only what is left: the end.
    assert list(rl.runs.stream(dpo_run.id, last_event_id=messages[-2].id)) == [messages[-1]]


def test_pipeline_create_get_cancel(rl: Client, pairs: DatasetRead) -> None:
    created = rl.pipelines.create({"name": "one", "stages": [{"name": "dpo", "spec": dpo(pairs.id, LONG)}]})
    assert isinstance(created, PipelineRead)
    assert created.status == "running" and created.stages[0].run_id is not None
    assert rl.pipelines.get(created.id).id == created.id
    assert rl.pipelines.cancel(created.id).status == "cancelled"
    assert rl.runs.wait(created.stages[0].run_id, timeout=60, interval=0.2).status == "cancelled"


def test_download_of_an_adapter_run_merges_it_first(rl: Client, pairs: DatasetRead, tmp_path: Path) -> None:
    import tarfile

    from transformers import AutoModelForCausalLM

    spec = {
        "algorithm": "dpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": str(pairs.id),
        "adapter": {"type": "lora", "r": 4, "alpha": 8},
        "hyperparameters": {"max_steps": 2, "batch_size": 4},
    }
    lora = rl.runs.wait(rl.runs.create(spec).id, timeout=180)
    assert lora.status == "succeeded", lora
    merges: list[RunRead] = []
    with pytest.raises(ApiError) as unmerged:
        rl.runs.download(lora.id, tmp_path / "x.tar", merge=False, on_merge=merges.append)
    assert unmerged.value.code == "merge_required" and not merges and not (tmp_path / "x.tar").exists()
    rl.runs.download(lora.id, tmp_path / "m.tar", on_merge=merges.append)
    (merge,) = merges  # one merge run was made and waited for
    assert merge.spec["algorithm"] == "merge" and merge.spec["model"] == f"run:{lora.id}"
    rl.runs.download(lora.id, tmp_path / "again.tar", on_merge=merges.append)
    assert len(merges) == 1  # the merged folder is there now: no second merge
    with tarfile.open(tmp_path / "m.tar") as tar:
        tar.extractall(tmp_path / "out", filter="data")
    (config,) = (tmp_path / "out").rglob("config.json")
    assert not (config.parent / "adapter_config.json").exists()  # a plain model, no peft needed
    assert AutoModelForCausalLM.from_pretrained(config.parent, use_safetensors=True) is not None
