"""One run on 2 ranks (gloo on CPU, started by torch's elastic launcher), of one host or one on each of two
hosts (trainer/hosts.py; tests/loops/host_helpers.py): DPO and GRPO over DDP and over FSDP2, and SFT with a
LoRA adapter over FSDP2, make the single-process run's updates on the same global batch, so their losses
and metrics match to 1e-5 over 10 steps, and the final model (written by rank 0 alone, gathered from the
shards under FSDP2) equals the single-process one. GRPO's ranks each sample their half of a step's prompts
(row-keyed sampling draws what one process would) and gather the rollouts. A rank that raises ends every
rank, naming it (a rank killed outright: tests/integration/test_multi_rank_runs.py, through the worker's
lost-worker path)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.loop_context import loop_ctx
from tests.loops.addition_rows import PAIRS, PROMPTS, SFT, VOWEL_REWARD
from tests.loops.host_helpers import two_hosts
from tests.loops.rank_helpers import (
    failing_context,
    memory_reporter,
    metrics_and_result,
    own_disk_context,
    rank_context,
    recording_context,
    resuming_context,
)
from trainer.loops import LOOPS
from trainer.models import load_causal_lm
from trainer.rank_launch import RankFailed, RankJob, launch
from trainer.reporting import MemoryReporter, RunData
from trainer.specs import parse_spec

# Ranks on CPU with gloo; on a machine with CUDA the ranks would take GPUs (tests/loops/test_gpu.py has the
# 2-GPU NCCL check), so these run where there is none.
gloo_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU gloo ranks; NCCL: test_gpu.py")

STEPS = 10


# GRPO: 4 prompts x 4 samples a step in 2 minibatches (2 updates), KL to the reference in the loss, and a
# greedy evaluation of 5 held-out prompts (an odd count: the ranks' shares wrap around) every 5 steps.
GRPO = {
    "prompts_per_step": 4,
    "samples_per_prompt": 4,
    "max_new_tokens": 6,
    "minibatch_size": 8,
    "eval_every": 5,
    "sample_every": 0,
}


def run_spec(algorithm: str = "dpo", **hp: Any) -> dict[str, Any]:
    online = algorithm == "grpo"
    return {
        "algorithm": algorithm,
        "model": "tiny:llama-0.4m",
        "dataset_id": str(uuid.uuid4()),
        **({"rewards": VOWEL_REWARD} if online else {}),
        "hyperparameters": {
            "max_steps": STEPS,
            "learning_rate": 1e-3,
            **(GRPO if online else {"batch_size": 4}),
            **hp,
        },
    }


def series(metrics: list[tuple[int, str, float]], key: str) -> list[float]:
    return [v for _, k, v in metrics if k == key]


def rows(spec: dict[str, Any]) -> RunData:
    if spec["algorithm"] == "grpo":
        return RunData(train=PROMPTS, validation=PROMPTS[-5:])
    return RunData(train=PAIRS if spec["algorithm"] == "dpo" else SFT)


def single(spec: dict[str, Any], tiny_cache: Path, out: Path) -> dict[str, Any]:
    reporter = MemoryReporter()
    result = LOOPS[spec["algorithm"]](parse_spec(spec), rows(spec), reporter, loop_ctx(tiny_cache, out))
    return metrics_and_result(reporter, result)


SINGLE: dict[str, dict[str, Any]] = {}  # one process's run of each plain spec, shared by DDP and FSDP2


def single_once(algorithm: str, tiny_cache: Path, out: Path) -> dict[str, Any]:
    if algorithm not in SINGLE:
        SINGLE[algorithm] = single(run_spec(algorithm), tiny_cache, out)
    return SINGLE[algorithm]


def rank_job(spec: dict[str, Any], context: Any, sharding: str = "ddp") -> RankJob:
    """``spec`` on the test rows, in ``context`` (a rank's loop context), with memory reporters."""
    return RankJob(
        spec=spec,
        data=rows(spec),
        context=context,
        reporter=memory_reporter,
        collect=metrics_and_result,
        sharding=sharding,  # type: ignore[arg-type]
    )


def two_ranks(spec: dict[str, Any], sharding: str, tiny_cache: Path, out: Path) -> dict[str, Any]:
    job = rank_job(spec, functools.partial(rank_context, str(tiny_cache), str(out)), sharding)
    result: dict[str, Any] = launch(job, 2)
    return result


KEYS = {
    "dpo": ("loss", "rewards/accuracy", "rewards/margin", "logps/chosen", "grad_norm", "final/loss"),
    "sft": ("loss", "token_accuracy", "grad_norm", "final/loss", "final/token_accuracy"),
    "grpo": (
        "loss/total",
        "loss/policy",
        "kl/ref",
        "kl/seq",
        "policy/entropy",
        "reward/mean",
        "adv/std",
        "response/length_mean",
        "grad_norm",
        "eval/accuracy",
    ),
}
COUNTS = {"final/loss": 1, "final/token_accuracy": 1, "eval/accuracy": 3}  # else one per step


@pytest.mark.slow
@gloo_only
@pytest.mark.parametrize(
    ("algorithm", "sharding"),
    [("dpo", "ddp"), ("dpo", "fsdp"), ("grpo", "ddp"), ("grpo", "fsdp")],
)
def test_two_ranks_make_the_single_process_updates(
    algorithm: str, sharding: str, tiny_cache: Path, tmp_path: Path
) -> None:
    one = single_once(algorithm, tiny_cache, tmp_path / "one")
    two = two_ranks(run_spec(algorithm), sharding, tiny_cache, tmp_path / "two")
    assert_single_process_updates(algorithm, one, two)


def assert_single_process_updates(algorithm: str, one: dict[str, Any], many: dict[str, Any]) -> None:
    """``many`` (rank 0's metrics and result) made ``one``'s updates: the same metrics to 1e-5 at every
    step, and the same final model (rank 0's save: the whole model, gathered from the shards)."""
    assert many["status"] == "succeeded"
    for key in KEYS[algorithm]:
        expected = series(one["metrics"], key)
        assert len(expected) == COUNTS.get(key, STEPS), key
        tolerance = {"rel": 1e-5} if key == "grad_norm" else {"abs": 1e-5}  # norms ~10: float32 rounding
        got = series(many["metrics"], key)
        if key == "rewards/accuracy":  # step 1: policy == reference, each implicit reward is float noise
            got, expected = got[1:], expected[1:]  # around 0 and its sign (the accuracy) means nothing
        assert got == pytest.approx(expected, **tolerance), key
    assert many["checkpoints"] == one["checkpoints"] == [STEPS]
    a, _ = load_causal_lm(one["output"])
    b, _ = load_causal_lm(many["output"])
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
@gloo_only
@pytest.mark.parametrize(
    ("algorithm", "sharding"),
    [("dpo", "ddp"), ("dpo", "fsdp"), ("grpo", "ddp"), ("grpo", "fsdp")],
)
def test_two_hosts_make_the_single_process_updates(
    algorithm: str, sharding: str, tiny_cache: Path, tmp_path: Path
) -> None:
    """One rank on each of two hosts (tests/loops/host_helpers.py; through worker processes:
    tests/integration/test_multi_host_runs.py): the same updates as one process, DDP and FSDP2."""
    one = single_once(algorithm, tiny_cache, tmp_path / "one")
    job = rank_job(
        run_spec(algorithm), functools.partial(rank_context, str(tiny_cache), str(tmp_path / "two")), sharding
    )
    lead, other = two_hosts(job)
    assert other is None  # rank 0, and with it the run's outputs, is on the leader's host
    assert_single_process_updates(algorithm, one, lead)


@pytest.mark.slow
@gloo_only
def test_a_lora_sft_run_on_sharded_ranks_builds_its_preset_once_and_matches(
    tiny_cache: Path, tmp_path: Path
) -> None:
    """SFT with LoRA over FSDP2, the ranks starting from an empty model cache: rank 0 builds the preset
    (transformers saves only on the main rank, so two ranks building it at once left a broken folder); the
    ranks' shares are normalised by the whole batch's completion tokens, and the adapter trains as in one
    process. Resumed on 2 ranks from its step-5 checkpoint (the adapter and its optimizer shards), it makes
    the same last 5 steps and the same adapter exactly."""
    spec = {**run_spec("sft", checkpoint_every=5), "adapter": {"r": 4, "alpha": 8}}
    one = single(spec, tiny_cache, tmp_path / "one")
    two = two_ranks(spec, "fsdp", tmp_path / "fresh-cache", tmp_path / "two")
    assert two["status"] == "succeeded" and two["checkpoints"] == [5, 10]
    for key in KEYS["sft"]:
        assert series(two["metrics"], key) == pytest.approx(series(one["metrics"], key), abs=1e-5), key
    # the saved adapter (rank 0 gathers only the trained tensors): one process's, every tensor of it
    from safetensors.torch import load_file

    ours = load_file(str(Path(two["output"]) / "adapter_model.safetensors"))
    theirs = load_file(str(Path(one["output"]) / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs) and any("lora_B" in name for name in ours)
    for name, tensor in theirs.items():
        torch.testing.assert_close(
            ours[name], tensor, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )

    fifth = tmp_path / "two" / "step-00000005"
    assert (fifth / "optimizer" / ".metadata").exists()
    resume = functools.partial(resuming_context, str(tmp_path / "fresh-cache"), str(tmp_path / "resumed"))
    resumed = launch(rank_job(spec, functools.partial(resume, str(fifth)), "fsdp"), 2)
    assert [m for m in resumed["metrics"] if m[1] in KEYS["sft"]] == [
        m for m in two["metrics"] if m[0] > 5 and m[1] in KEYS["sft"]
    ]
    again = load_file(str(Path(resumed["output"]) / "adapter_model.safetensors"))
    assert sorted(again) == sorted(ours) and all(torch.equal(again[n], ours[n]) for n in ours)


@pytest.mark.slow
@gloo_only
def test_sharded_ranks_checkpoint_their_own_optimizer_shards_and_resume_from_them_exactly(
    tiny_cache: Path, tmp_path: Path
) -> None:
    """FSDP2 over 2 ranks: a checkpoint's optimizer state is written by each rank as its own shards
    (optimizer/, one file per rank holding about half of Adam's moments; none in trainer_state.pt); a run
    resumed from it on 2 ranks makes the uninterrupted run's last steps exactly, and one process reads the
    shards back whole (one process's run has the same state, to float32 rounding). A checkpoint of the
    format before (the whole state in trainer_state.pt) still resumes on sharded ranks."""
    spec = run_spec("dpo", max_steps=6, checkpoint_every=3, keep_last_checkpoints=5)
    straight = two_ranks(spec, "fsdp", tiny_cache, tmp_path / "straight")
    assert straight["checkpoints"] == [3, 6]
    third = tmp_path / "straight" / "step-00000003"
    shards = third / "optimizer"
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert torch.load(third / "trainer_state.pt", weights_only=False)["optimizer"] is None
    model, _ = load_causal_lm(str(third))
    moments = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # exp_avg, exp_avg_sq
    sizes = [(shards / f"__{rank}_0.distcp").stat().st_size for rank in (0, 1)]
    assert all(0.35 * moments < size < 0.65 * moments for size in sizes), (sizes, moments)

    job = rank_job(
        spec,
        functools.partial(resuming_context, str(tiny_cache), str(tmp_path / "resumed"), str(third)),
        "fsdp",
    )
    resumed = launch(job, 2)
    assert resumed["checkpoints"] == [6]
    steps = sorted({s for s, k, _ in resumed["metrics"] if k == "loss"})
    assert steps == [4, 5, 6]
    later = [(s, k, v) for s, k, v in straight["metrics"] if s > 3 and k in KEYS["dpo"]]
    assert [(s, k, v) for s, k, v in resumed["metrics"] if k in KEYS["dpo"]] == later
    a, _ = load_causal_lm(straight["output"])
    b, _ = load_causal_lm(resumed["output"])
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), name

    # one process reads the whole state from the shards; its own run of the spec holds the same state
    from trainer.distributed import load_optimizer_shards
    from trainer.loops.session import make_optimizer

    one = single(spec, tiny_cache, tmp_path / "one")
    assert one["checkpoints"] == [3, 6]
    expected = torch.load(tmp_path / "one" / "step-00000003" / "trainer_state.pt", weights_only=False)
    optimizer = make_optimizer(model, 1e-3, 0.0, "fp32")
    load_optimizer_shards(model, optimizer, shards)
    got = optimizer.state_dict()["state"]
    assert len(got) == len(expected["optimizer"]["state"]) == len(list(model.parameters()))
    for index, state in expected["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[index][key], state[key], atol=1e-6, rtol=1e-4)
        assert float(got[index]["step"]) == float(state["step"]) == 3

    # a sharded run's checkpoint from before the shards (the whole optimizer state in trainer_state.pt,
    # keyed by parameter names, as torch's full_state_dict gathered it) still resumes on sharded ranks:
    # made here from one process's, it continues with one process's last steps
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    old = tmp_path / "old" / "step-00000003"
    shutil.copytree(tmp_path / "one" / "step-00000003", old)
    optimizer = make_optimizer(model, 1e-3, 0.0, "fp32")
    optimizer.load_state_dict(expected["optimizer"])
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    expected["optimizer"] = dict(get_optimizer_state_dict(model, optimizer, options=full))
    torch.save(expected, old / "trainer_state.pt")
    folder = str(tmp_path / "from-old")
    job = rank_job(spec, functools.partial(resuming_context, str(tiny_cache), folder, str(old)), "fsdp")
    from_old = launch(job, 2)
    later = [v for s, k, v in one["metrics"] if s > 3 and k == "loss"]
    assert len(later) == 3
    assert [v for _, k, v in from_old["metrics"] if k == "loss"] == pytest.approx(later, abs=1e-5)


@pytest.mark.slow
@gloo_only
def test_sharded_ranks_that_do_not_share_the_artifacts_folder_fail_at_the_first_checkpoint_saying_so(
    tiny_cache: Path, tmp_path: Path
) -> None:
    """Each rank writes its optimizer shards into the checkpoint folder rank 0 made: a rank on a host
    without the shared artifacts folder fails naming it, and no checkpoint is left looking whole."""
    spec = run_spec("dpo", max_steps=2, checkpoint_every=1)
    job = rank_job(spec, functools.partial(own_disk_context, str(tiny_cache), str(tmp_path)), "fsdp")
    with pytest.raises(
        RankFailed, match=r"rank 1 of 2 failed: RuntimeError: rank 1 does not see .*RLRUN_ARTIFACTS_DIR"
    ):
        launch(job, 2)
    assert not list(tmp_path.glob("rank*/step-*"))


@pytest.mark.slow
@gloo_only
def test_a_rank_that_fails_ends_every_rank_naming_it_and_why(tiny_cache: Path, tmp_path: Path) -> None:
    job = RankJob(
        spec=run_spec(),
        data=RunData(train=PAIRS),
        context=functools.partial(failing_context, str(tiny_cache), str(tmp_path)),
        reporter=memory_reporter,
        collect=metrics_and_result,
    )
    with pytest.raises(RankFailed, match=r"rank 1 of 2 failed: [^;]*OSError: rank 1 lost its disk"):
        launch(job, 2)  # rank 0, waiting for rank 1 in the first collective, is ended too


@pytest.mark.slow
@gloo_only
def test_ranks_take_the_launchers_environment_and_folder_of_the_moment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks are forked from a server started by this process's first launch; each launch's ranks still see
    the launcher's environment and working folder as they are at that launch (as spawned ranks would), and
    the thread count the launcher gives them."""
    monkeypatch.setenv("RLRUN_RANK_GONE", "set before the first launch")
    pids = set()
    for mark in ("first", "second"):
        folder = tmp_path / mark
        folder.mkdir()
        monkeypatch.setenv("RLRUN_RANK_MARK", mark)
        monkeypatch.chdir(folder)
        job = RankJob(
            spec=run_spec(),
            data=RunData(train=PAIRS),
            context=functools.partial(recording_context, str(folder)),
            reporter=memory_reporter,
            collect=metrics_and_result,
        )
        with pytest.raises(RankFailed, match="RuntimeError: recorded"):
            launch(job, 2)
        for rank in (0, 1):
            seen = json.loads((folder / f"rank{rank}.json").read_text())
            pids.add(seen.pop("pid"))
            gone = "set before the first launch" if mark == "first" else None
            threads = max(1, (os.cpu_count() or 1) // 2)
            assert seen == {"mark": mark, "gone": gone, "cwd": str(folder), "threads": threads}
        monkeypatch.delenv("RLRUN_RANK_GONE", raising=False)
    assert len(pids) == 4 and os.getpid() not in pids  # a process per rank and launch


@pytest.mark.slow
@gloo_only
def test_ranks_end_when_the_process_that_launched_them_is_killed(tiny_cache: Path, tmp_path: Path) -> None:
    """A worker killed with -9 leaves no rank behind: its forkserver sees the worker gone and exits, and
    each rank dies with its parent (PR_SET_PDEATHSIG)."""
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import functools, sys\n"
            "from tests.loops.addition_rows import PAIRS\n"
            "from tests.loops.rank_helpers import hanging_context, memory_reporter, metrics_and_result\n"
            "from tests.loops.test_distributed import run_spec\n"
            "from trainer.rank_launch import RankJob, launch\n"
            "from trainer.reporting import RunData\n"
            "job = RankJob(spec=run_spec(), data=RunData(train=PAIRS),\n"
            "    context=functools.partial(hanging_context, sys.argv[1]),\n"
            "    reporter=memory_reporter, collect=metrics_and_result)\n"
            "launch(job, 2)\n",
            str(tmp_path),
        ],
        cwd=Path(__file__).parents[2],
    )
    try:
        files = [tmp_path / f"rank{rank}.pid" for rank in (0, 1)]
        deadline = time.monotonic() + 120
        while not all(f.is_file() and f.read_text() for f in files):
            assert launcher.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.2)
        ranks = [int(f.read_text()) for f in files]
        assert all(alive(pid) for pid in ranks)
        launcher.kill()
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in ranks):
            assert time.monotonic() < deadline, "a rank outlived its launcher by 10 s"
            time.sleep(0.1)
    finally:
        launcher.kill()
        launcher.wait(timeout=10)


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, dead but not yet reaped by whoever inherited it, does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_worker_refuses_more_devices_than_it_sees_saying_how_many() -> None:
    import os

    from trainer.worker_ranks import check_devices

    have = torch.cuda.device_count() if torch.cuda.is_available() else os.cpu_count() or 1
    check_devices(have)
    with pytest.raises(ValueError, match=rf"resources.devices is {have + 1} but this worker sees {have} "):
        check_devices(have + 1)


def test_a_short_share_is_filled_with_rows_that_count_for_nothing() -> None:
    """5 rows over 2 ranks: rank 0 takes rows 0-2, rank 1 rows 3, 4 and a filler (row 0 again) whose mask
    is zero and which is not counted as a row (no process group needed: the split is arithmetic)."""
    from trainer.distributed import Ranks
    from trainer.loops.rl_common import ActorBatch, TokenBatch

    ids = torch.arange(5)[:, None].repeat(1, 3)
    tokens = TokenBatch(ids, torch.ones_like(ids), torch.ones(5, 2))
    batch = ActorBatch(tokens, torch.ones(5, 2), torch.arange(5.0), None, None)
    zero, one = batch.rank_share(Ranks(0, 2)), batch.rank_share(Ranks(1, 2))
    assert zero.adv.tolist() == [0, 1, 2] and zero.mask.sum() == 6 and float(zero.n_real) == 3
    assert one.adv.tolist() == [3, 4, 0] and one.mask.tolist() == [[1, 1], [1, 1], [0, 0]]
    assert float(one.n_real) == 2
