"""Issue 40 through the official `tinker` SDK only, as its docs show, against `rlrun serve` (API, a real
worker, SQLite): a supervised loop whose loss falls, `forward` log-probs that agree with the training
call's, the session as a run with its loss per call and its adapter as the run's model, and the errors the
SDK must raise at once rather than retry."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from tests.integration.flow import FINISHED, all_metrics, embedded_server, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with embedded_server(tmp_path_factory.mktemp("tinker")) as client:
        yield client


@pytest.fixture
def sdk_env(served: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """The three lines of setup the README shows: the server's URL, a key (any tml-... with auth off)."""
    monkeypatch.setenv("TINKER_BASE_URL", str(served.base_url))
    monkeypatch.setenv("TINKER_API_KEY", "tml-anything")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


def all_runs(served: httpx.Client) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = served.get("/v1/runs", params={"limit": 200}).json()["data"]
    return runs


def sft_data(tokenizer: Any, n: int) -> list[types.Datum]:
    """The addition SFT examples as datums: prompt then completion, only the completion weighted."""
    rows = [json.loads(line) for line in (EXAMPLES / "sft_addition.jsonl").read_text().splitlines()[:n]]
    data = []
    for r in rows:
        prompt = tokenizer.encode(r["prompt"])
        completion = tokenizer.encode(r["completion"], add_special_tokens=False) + [tokenizer.eos_token_id]
        tokens = prompt + completion
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
            )
        )
    return data


def test_a_supervised_loop_through_the_sdk_lowers_its_loss(served: httpx.Client, sdk_env: None) -> None:
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model="tiny:llama-0.4m", rank=8).result()
    tokenizer = training.get_tokenizer()
    data = sft_data(tokenizer, 8)
    losses = []
    for _ in range(8):
        fb = training.forward_backward(data, loss_fn="cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=1e-2))  # pipelined, as the docs do
        result = fb.result()
        step.result()
        losses.append(result.metrics["loss:sum"])
    assert losses[-1] < 0.8 * losses[0], losses
    # forward (no gradient) gives the log-probs the loss is made of: loss:sum = -sum w * logprob
    out = training.forward(data, loss_fn="cross_entropy").result()
    weighted = sum(
        -w * lp
        for d, o in zip(data, out.loss_fn_outputs, strict=True)
        for w, lp in zip(d.loss_fn_inputs["weights"].tolist(), o["logprobs"].tolist(), strict=True)
    )
    assert out.metrics["loss:sum"] == pytest.approx(weighted, rel=1e-4)
    assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == len(data[0].model_input.to_ints())
    # the session is a run: its loss per forward_backward call, and its adapter as the run's model
    model_id = training.model_id
    run = next(r for r in all_runs(served) if r["spec"].get("name") == model_id)
    assert run["algorithm"] == "training_session" and run["status"] == "running"
    service.close("success")  # sessions/{id}/finish: the worker saves the adapter and stops
    done = wait_for(served, run["id"], lambda r: r["status"] in FINISHED)
    assert done["status"] == "succeeded", done
    assert Path(done["output_path"], "adapter_config.json").exists()
    loss = [m for m in all_metrics(served, run["id"]) if m["key"] == "loss"]
    assert [m["step"] for m in loss] == list(range(1, 10))  # 8 forward_backward calls and the forward


def rl_datum(prompt: list[int], sample: Any, advantage: float) -> types.Datum:
    """A sampled continuation as an ``importance_sampling`` datum: the sampler's log-probs and the
    advantage on the sampled tokens, 0 on the prompt's."""
    tokens = prompt + list(sample.tokens)
    pad = [0.0] * (len(prompt) - 1)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": pad + list(sample.logprobs),
            "advantages": pad + [advantage] * len(sample.tokens),
        },
    )


def test_an_rl_loop_samples_scores_and_trains_with_sampler_logprobs(
    served: httpx.Client, sdk_env: None
) -> None:
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model="tiny:llama-0.4m", rank=8).result()
    prompt = training.get_tokenizer().encode("7+5=")
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    first = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=4, sampling_params=params).result()
    assert len(first.sequences) == 4 and all(len(s.tokens) == len(s.logprobs) for s in first.sequences)
    # the sampler's log-probs are the policy's: forward on the same tokens (no step taken yet) agrees
    data = [rl_datum(prompt, s, 0.0) for s in first.sequences]
    out = training.forward(data, loss_fn="importance_sampling").result()
    for s, o in zip(first.sequences, out.loss_fn_outputs, strict=True):
        assert o["logprobs"].tolist()[len(prompt) - 1 :] == pytest.approx(s.logprobs, abs=1e-4)
    # the loop: sample, reward (longer answers pay), importance_sampling, step; from a named snapshot too
    for step in range(3):
        path = training.save_weights_for_sampler(f"step-{step}").result().path
        assert path == f"tinker://{training.model_id}/sampler_weights/step-{step}"
        sampler = service.create_sampling_client(model_path=path).result()
        got = sampler.sample(
            types.ModelInput.from_ints(prompt), num_samples=4, sampling_params=params
        ).result()
        rewards = [float(len(s.tokens)) for s in got.sequences]
        mean = sum(rewards) / len(rewards)
        data = [rl_datum(prompt, s, r - mean) for s, r in zip(got.sequences, rewards, strict=True)]
        result = training.forward_backward(data, loss_fn="importance_sampling").result()
        assert math.isfinite(result.metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    service.close("success")


def test_a_saved_state_loads_into_a_new_client_with_the_same_loss(
    served: httpx.Client, sdk_env: None
) -> None:
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model="tiny:llama-0.4m", rank=8).result()
    data = sft_data(training.get_tokenizer(), 4)
    for _ in range(3):
        training.forward_backward(data, loss_fn="cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = training.save_state("after-3").result().path
    assert path == f"tinker://{training.model_id}/weights/after-3"
    saved_loss = training.forward(data, loss_fn="cross_entropy").result().metrics["loss:sum"]
    rest = service.create_rest_client()  # the SDK's listings
    listed = rest.list_checkpoints(training.model_id).result().checkpoints
    assert [(c.checkpoint_type, c.tinker_path) for c in listed] == [("training", path)]
    runs = rest.list_training_runs(limit=50).result().training_runs
    mine = next(r for r in runs if r.training_run_id == training.model_id)
    assert (mine.base_model, mine.lora_rank, mine.last_checkpoint.tinker_path) == ("tiny:llama-0.4m", 8, path)
    with pytest.raises(tinker.RequestFailedError, match="exists"):
        training.save_state("after-3").result()  # a name is not overwritten unless asked
    run = next(r for r in all_runs(served) if r["spec"].get("name") == training.model_id)
    (checkpoint,) = served.get(f"/v1/runs/{run['id']}/checkpoints").json()
    assert (
        checkpoint["step"] == 3 and checkpoint["model_ref"] == f"run:{run['id']}@3"
    )  # a model, as any run's
    assert served.post(f"/v1/runs/{run['id']}/cancel").status_code == 200  # as the dashboard cancels
    assert wait_for(served, run["id"], lambda r: r["status"] in FINISHED)["status"] == "cancelled"
    with pytest.raises(tinker.BadRequestError, match="is over"):  # a session that ended
        training.forward(data, loss_fn="cross_entropy").result()
    service.close("success")
    again = tinker.ServiceClient()
    loaded = again.create_training_client_from_state_with_optimizer(path).result()
    assert loaded.forward(data, loss_fn="cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        saved_loss, rel=1e-5
    )
    with pytest.warns(FutureWarning), pytest.raises(tinker.BadRequestError, match="load_state"):
        loaded.load_state(path).result()  # into an existing client (deprecated by the SDK): not supported
    again.close("success")


def test_the_sdk_raises_at_once_for_bad_input(served: httpx.Client, sdk_env: None) -> None:
    service = tinker.ServiceClient()
    with pytest.raises(tinker.APIStatusError) as unknown:
        service.create_lora_training_client(base_model="org/no-such-model", rank=8).result()
    assert "no-such-model" in str(unknown.value)
    training = service.create_lora_training_client(base_model="tiny:llama-0.4m", rank=4).result()
    mismatched = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 1.0]},
    )
    with pytest.raises(tinker.BadRequestError) as bad:
        training.forward_backward([mismatched], loss_fn="cross_entropy").result()
    assert "but the datum has 3 input tokens" in str(bad.value)
    with pytest.raises((tinker.BadRequestError, ValueError)) as negative:
        training.optim_step(types.AdamParams(learning_rate=-1.0)).result()
    assert "adam_params.learning_rate: must be >= 0" in str(negative.value)  # the server's refusal
    ok = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
    )
    assert training.forward_backward([ok], loss_fn="cross_entropy").result().metrics["loss:sum"] > 0
    with pytest.raises(tinker.BadRequestError, match="a name of 1-64 letters"):
        training.save_state("no spaces allowed").result()
    with pytest.raises(tinker.BadRequestError, match="sampling a bare base model"):
        service.create_sampling_client(base_model="tiny:llama-0.4m").result()
    service.close("success")  # the session ends: its worker is free for the next
