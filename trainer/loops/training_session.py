"""The loop of a training session (``algorithm: training_session``, issue 40): the base model with a fresh
LoRA adapter, held while the caller's own loop drives it call by call through the Tinker protocol
(api/routers/tinker.py proxies the SDK's calls to this process's session gateway,
trainer/primitives/commands.py).

- ``forward_backward`` (and ``forward``, the same without gradients): for each datum, the model's
  log-probs of its ``target_tokens`` given its input tokens, the datum's loss (trainer/primitives/losses.py)
  and, unless forward only, its gradient added to the adapter's (gradients accumulate until the next
  ``optim_step``); the result carries each datum's ``logprobs`` and ``elementwise_loss`` and ``loss:sum``.
- ``optim_step``: one AdamW step with the call's ``adam_params`` (learning rate, betas, eps, decoupled
  weight decay; ``grad_clip_norm`` > 0 clips the gradients' global norm first), then the gradients are
  cleared.
- ``save_weights_for_sampler`` and ``sample``: snapshots of the adapter, and samples with log-probs from
  one (trainer/primitives/sampling.py).

The run's metrics: ``loss`` (``loss:sum`` per target token) at each ``forward_backward``, numbered by
call. The session ends when the caller finishes it, after ``idle_timeout_s`` without a call (both
succeed, the adapter saved as the run's model) or when the run is cancelled. A session whose worker was lost
does not resume on another (its weights since the last ``save_state`` were that worker's): the next attempt
fails the run saying so, and the SDK's calls answer that the session is over.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from trainer.adapters import add_adapter, load_trainable_state, trainable_state
from trainer.models import load_causal_lm, pick_device
from trainer.primitives.commands import CommandQueue, SessionGateway
from trainer.primitives.losses import check_config, check_datum, per_token_loss
from trainer.primitives.sampling import Snapshots, parse_sample, parse_snapshot
from trainer.primitives.wire import (
    ForwardBackwardRequest,
    WireError,
    forward_backward_output,
    parse_forward_backward,
)
from trainer.reporting import LoopContext, LoopResult, Reporter, RunData
from trainer.specs import AdapterSpec, TrainingSessionSpec
from trainer.specs.session import OPTIMIZER_FILE, TRAINABLE_FILE, SessionState

STOP_CHECK_SECONDS = 2.0
STARTED_MARK = "session.started"  # a second attempt of the run finds it: the session's state is gone


def checker(vocab: int, max_length: int) -> Any:
    """What the gateway runs on a call before queueing it: the parsed call, or a ``WireError``."""

    def check(kind: str, raw: bytes) -> Any:
        if kind == "forward_backward":
            request = parse_forward_backward(raw)
            clip = check_config(request.loss_fn, request.config)
            for i, d in enumerate(request.data):
                check_datum(request.loss_fn, d, f"data[{i}]")
                if len(d.tokens) > max_length:
                    raise WireError(f"{len(d.tokens)} tokens; this session takes {max_length}", f"data[{i}]")
                targets = d.inputs["target_tokens"]
                if (
                    min(d.tokens) < 0
                    or max(d.tokens) >= vocab
                    or int(targets.min()) < 0
                    or int(targets.max()) >= vocab
                ):
                    raise WireError(f"token ids must be in [0, {vocab})", f"data[{i}]")
            return request, clip
        if kind == "optim_step":
            return adam_params(raw)
        if kind in ("save_sampler", "save_state"):
            body = json.loads(raw or b"{}")
            return parse_snapshot(raw), body.get("reply") or {}, bool(body.get("overwrite"))
        if kind == "sample":
            return parse_sample(raw, vocab, max_length)
        return None

    return check


ADAM_DEFAULTS = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}


def adam_params(raw: bytes) -> dict[str, float]:
    """An ``optim_step`` body's ``adam_params``, defaults filled in.

    Raises:
        WireError: not JSON, or a value out of range (a negative learning rate, betas outside [0, 1), ...).
    """
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise WireError("not JSON", "body") from None
    given = body.get("adam_params") or body.get("optim_params") or {}
    if not isinstance(given, dict):
        raise WireError("must be an object", "adam_params")
    out = dict(ADAM_DEFAULTS)
    for key, value in given.items():
        if key not in ADAM_DEFAULTS:
            continue  # fields of later SDKs this server does not use
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise WireError(f"must be a number, got {value!r}", f"adam_params.{key}")
        out[key] = float(value)
    for key, ok, rule in [
        ("learning_rate", out["learning_rate"] >= 0, ">= 0"),
        ("beta1", 0 <= out["beta1"] < 1, "in [0, 1)"),
        ("beta2", 0 <= out["beta2"] < 1, "in [0, 1)"),
        ("eps", out["eps"] > 0, "> 0"),
        ("weight_decay", out["weight_decay"] >= 0, ">= 0"),
        ("grad_clip_norm", out["grad_clip_norm"] >= 0, ">= 0 (0: no clipping)"),
    ]:
        if not ok:
            raise WireError(f"must be {rule}, got {out[key]}", f"adam_params.{key}")
    return out


def forward_backward(
    model: Any, request: ForwardBackwardRequest, clip: Any, device: torch.device
) -> tuple[bytes, float, int]:
    """Execute one ``forward_backward`` (module docstring): the result's bytes, ``loss:sum`` and the number
    of target tokens."""
    total, tokens = 0.0, 0
    logprobs, losses = [], []
    grad = torch.enable_grad() if not request.forward_only else torch.no_grad()
    with grad:
        for d in request.data:
            ids = torch.tensor([d.tokens], device=device)
            targets = d.inputs["target_tokens"].to(device)
            logits = model(input_ids=ids).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
            per = per_token_loss(request.loss_fn, lp, {k: v.to(device) for k, v in d.inputs.items()}, clip)
            loss = per.sum()
            if not request.forward_only:
                loss.backward()  # type: ignore[no-untyped-call]
            total += float(loss.detach())
            tokens += len(d.tokens)
            logprobs.append(lp.detach().cpu())
            losses.append(per.detach().cpu())
    kind = "ForwardReturn" if request.forward_only else "ForwardBackwardReturn"
    raw = forward_backward_output(
        {"logprobs": logprobs, "elementwise_loss": losses}, {"loss:sum": total}, kind
    )
    return raw, total, tokens


def optim_step(model: Any, optimizer: torch.optim.Optimizer, params: dict[str, float]) -> dict[str, float]:
    """One AdamW step with ``params``; the step's metrics (``grad_norm:mean`` before clipping)."""
    for group in optimizer.param_groups:
        group.update(
            lr=params["learning_rate"],
            betas=(params["beta1"], params["beta2"]),
            eps=params["eps"],
            weight_decay=params["weight_decay"],
        )
    trainable = [p for p in model.parameters() if p.requires_grad]
    clip = params["grad_clip_norm"] or math.inf
    norm = float(torch.nn.utils.clip_grad_norm_(trainable, clip))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm:mean": norm if math.isfinite(norm) else 0.0}


def save_state(
    model: Any, tokenizer: Any, optimizer: torch.optim.Optimizer, folder: Path, overwrite: bool
) -> None:
    """The SDK's ``save_state``: the adapter as a peft folder (a model like any run's checkpoint) with
    its tensors and the optimizer's state beside it, for ``load_state``.

    Raises:
        WireError: the name is taken and ``overwrite`` is off.
    """
    if folder.exists() and not overwrite:
        raise WireError(f"a state named {folder.name!r} exists (overwrite it with overwrite=True)", "path")
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    torch.save(trainable_state(model), partial / TRAINABLE_FILE)
    torch.save(optimizer.state_dict(), partial / OPTIMIZER_FILE)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


def load_state(model: Any, optimizer: torch.optim.Optimizer, checkpoints: Path, state: SessionState) -> None:
    """Start from a saved state (``save_state``): the adapter's tensors, and the optimizer's on request.

    Raises:
        ValueError: no such state, or one of another base model or rank.
    """
    folder = checkpoints / "weights" / state.name
    if not (folder / TRAINABLE_FILE).exists():
        raise ValueError(f"run {state.run_id} saved no state named {state.name!r}")
    load_trainable_state(model, torch.load(folder / TRAINABLE_FILE, map_location="cpu"))
    if state.optimizer:
        optimizer.load_state_dict(torch.load(folder / OPTIMIZER_FILE, map_location="cpu"))


def run_training_session(
    spec: TrainingSessionSpec,
    data: RunData,  # noqa: ARG001 - every loop takes the same arguments; a session reads no rows
    reporter: Reporter,
    ctx: LoopContext,
) -> LoopResult:
    hp = spec.hyperparameters
    started = ctx.checkpoint_dir / STARTED_MARK
    if started.exists():
        raise RuntimeError(
            "a training session cannot continue after its worker was lost: the model's state since its "
            "last save_state lived in that worker; create a new training client (from a saved state with "
            "create_training_client_from_state)"
        )
    ctx.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    started.touch()
    torch.manual_seed(hp.seed)
    device = pick_device()
    path = ctx.resolve_model(spec.model)
    with reporter.phase("model_load"):
        model, tokenizer = load_causal_lm(path)
        model = add_adapter(model, AdapterSpec(r=hp.lora_rank, alpha=hp.lora_rank), "causal")
    model.to(device).train()
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=ADAM_DEFAULTS["learning_rate"]
    )
    if spec.load_state is not None:
        state = spec.load_state
        load_state(
            model, optimizer, ctx.checkpoint_dir.parent.parent / str(state.run_id) / "checkpoints", state
        )
        reporter.event("info", f"started from state {state.name!r} of run {state.run_id}")
    queue = CommandQueue(checker(int(model.config.vocab_size), hp.max_length))
    snapshots = Snapshots(model, tokenizer)
    gateway = SessionGateway(queue)
    ctx.cleanup.callback(gateway.close)
    ctx.cleanup.callback(queue.close, "the session is over")
    ctx.cleanup.callback(reporter.agent_gateway, None)
    reporter.agent_gateway(gateway.address | {"model_path": str(path)})  # the SDK's tokenizer folder
    reporter.event("info", f"session ready: {spec.model} with a rank-{hp.lora_rank} LoRA adapter")
    calls = steps = 0
    status, why = "succeeded", "finished by the caller"
    next_check = time.monotonic() + STOP_CHECK_SECONDS
    while True:
        command = queue.take(wait=1.0)
        if command is None:
            if queue.idle_for() > hp.idle_timeout_s:
                why = f"idle for {hp.idle_timeout_s:g} s"
                break
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + STOP_CHECK_SECONDS
                if reporter.should_stop():
                    status = "cancelled"
                    break
            continue
        if command.kind == "finish":
            queue.finish(command, b"{}")
            break
        try:
            if command.kind == "forward_backward":
                request, clip = command.payload
                raw, total, tokens = forward_backward(model, request, clip, device)
                queue.finish(command, raw, "application/x-protobuf")
                calls += 1
                reporter.log_metrics(calls, {"loss": total / max(tokens, 1), "tokens": float(tokens)})
            elif command.kind == "optim_step":
                metrics = optim_step(model, optimizer, command.payload)
                steps += 1
                queue.finish(command, json.dumps({"metrics": metrics}).encode())
            elif command.kind == "save_sampler":
                name, reply, _ = command.payload
                snapshots.save(name)
                queue.finish(command, json.dumps(reply).encode())
            elif command.kind == "save_state":
                name, reply, overwrite = command.payload
                folder = ctx.checkpoint_dir / "weights" / name
                save_state(model, tokenizer, optimizer, folder, overwrite)
                # a checkpoint of the run at its optimizer step: run:<id>@<step> is a model (the latest
                # save at a step is the one its checkpoint names)
                size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
                reporter.checkpoint_saved(steps, folder, size, {"optim_steps": float(steps)})
                queue.finish(command, json.dumps(reply).encode())
            else:
                queue.finish(command, snapshots.sample(command.payload), "application/x-protobuf")
        except WireError as exc:
            queue.fail(command, str(exc))
    queue.close("the session is over")
    reporter.event("info", f"session over ({why}): {calls} forward_backward calls, {steps} optimizer steps")
    if status != "succeeded":
        return LoopResult(status="cancelled", output_path=None)
    out = ctx.checkpoint_dir / "final"
    with reporter.phase("checkpoint"):
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    return LoopResult(
        status="succeeded",
        output_path=out,
        final_metrics={"final/optim_steps": float(steps), "final/calls": float(calls)},
    )
