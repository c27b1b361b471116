"""Seconds per GRPO step: rlrun's ``run_group_rl`` against TRL's ``GRPOTrainer``, same model, data, settings.

Both train the built-in ``tiny:llama-10m`` (random-init Llama, ~11M parameters) from the same folder on
the same 64 addition prompts (``a+b=``, answer ``a+b``): 2 prompts x G=4 completions = 8 completions per
step, 16 new tokens each, temperature 1.0 (top_p 1, top_k off), no KL (kl_coef 0 / beta 0, so neither
loads a reference model), one policy pass and one AdamW step per generation batch (ppo_epochs 1 /
num_iterations 1), lr 1e-4 constant, clip 0.2, std-normalised group advantages, per-sequence token-mean
loss (rlrun's ``grpo`` preset / TRL's ``loss_type="grpo"``), grad clip 1.0, fp32 on CPU, HF ``generate``
(rlrun's hf engine; TRL without vLLM). The reward is the same function in both: rlrun's ``numeric``
verifier (1.0 when the completion's last number equals the answer), called by rlrun's reward registry and,
for TRL, by a reward function with TRL's signature.

Completion lengths are made equal: both models' ``generate`` is wrapped to pass ``min_new_tokens=16``
(EOS is masked until the budget is spent), so every completion is exactly 16 tokens in both. The same
wrapper times each ``generate`` call, so ``generate s/step`` is measured the same way for both.

``--engine vllm_server`` makes rlrun generate through its engine process (vLLM's server from
``.venv-engine``, started by the run and inside its timed setup; issue 37) instead of HF ``generate``; TRL
keeps the only engine it has on CPU. Lengths are made equal there with vLLM's ``min_tokens`` (the engine's
request is wrapped), ``generate s/step`` is the wall time of the engine's generate calls, and the weight
sync before each step is timed apart (``sync s/step``, part of ``rest``). With the engine rlrun also takes
the old policy's log-probs in a no-grad pass each step (the sampler-mismatch metrics need them), unless
``--old-logprobs sampler`` takes them from the engine (the ratio anchored on the sampler's log-probs).
``--shape PxG`` sets prompts per step and completions per prompt (default 2x4; ``bench/learning.py`` uses
16x8). ``--async-rollouts 1`` (with the engine) generates each next step's rollouts during this step's
update (one step off-policy, trainer/loops/async_rollouts.py): ``generate s/step`` then counts the
background generation too, so only ``s/step`` and ``steady`` compare with the plain path.

What is timed, for each, from one clock start to the end of the last optimizer step:

- rlrun: the ``run_group_rl`` call, with the model loading replaced by an already loaded copy. This
  includes tokenizing the prompts and building the engine, the reward and the optimizer. The final-model
  save after the last step is not timed (TRL saves nothing); no validation set, so no eval.
- TRL: ``GRPOTrainer(...)`` (dataset preparation, accelerator setup) plus ``trainer.train()``, with the
  policy passed in already loaded.

``s/step`` is that total over the steps; ``steady s/step`` leaves out setup and the first warm-up steps;
``cpu s/step`` is the process's CPU time (all threads) over the same span as ``s/step``. Wall times
swing with other load on a shared machine; CPU time less so, but it too is inflated when torch's worker
threads spin while a sibling is descheduled (with 2 threads on 2 busy cores, by a lot).
``load`` is the 1-minute load average when that contender finished: the two run one after the other,
so a ratio only means something when both saw the same load.
``ratio = TRL s/step / rlrun s/step``: above 1 means rlrun is faster. ``generate s/step`` is the wall time
inside ``model.generate`` per step; ``rest s/step`` is ``s/step`` minus that (log-probs, loss, backward,
optimizer, rewards, bookkeeping, and the setup spread over the steps). rlrun's own split (``perf/gen_s``:
generate + decode + rewards; ``perf/train_s``: log-probs, advantages, update) is printed below the table.

``--model-folder`` trains a real model instead (a folder ``rlrun models import smollm2-135m-instruct``
made: 135M parameters, full fine-tuning in fp32 for both; the prompts stay plain ``a+b=`` text, no chat
template, in both).

Run: ``make bench`` (runs every file in bench/) or ``.venv/bin/python bench/grpo_vs_trl.py --steps N``
after ``.venv/bin/pip install -e '.[dev,bench]'``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import shlex
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from clock import (  # sibling modules: python puts bench/
    StepTimes,
    TimedReporter,
    loop_context,
    stamp,
    trl_step_clock,
)
from common import quiet  # first on sys.path (so does learning.py)

from trainer.loops import group_rl as group_rl_loop
from trainer.loops import session as session_module
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.reporting import RunData
from trainer.rewards.verifiers import Sample, numeric
from trainer.specs import GroupRlSpec, parse_spec

PRESET = "llama-10m"
MODEL_REF = f"tiny:{PRESET}"  # --model-folder replaces it with that folder's path
N_PROMPTS = 64
PROMPTS_PER_STEP = 2
G = 4  # completions per prompt
NEW_TOKENS = (16, 128)  # the completion budgets the bench runs by default (--new-tokens)
MAX_PROMPT_LENGTH = 32
LR = 1e-4
CLIP = 0.2
TEMPERATURE = 1.0
SEED = 0


@dataclass
class Timing(StepTimes):
    """Clock readings of one training run, its generate time and its completion lengths and rewards."""

    generate_s: float  # wall seconds inside model.generate over the timed span
    completion_length: float  # mean tokens per completion over all steps
    reward: float  # mean reward over all steps
    new_tokens: int = 0
    sync_s: float = 0.0  # wall seconds syncing the engine's weights (rlrun with an engine process)
    load: float = field(default_factory=lambda: os.getloadavg()[0])  # 1-minute load average at the end

    @property
    def generate_per_step_s(self) -> float:
        return self.generate_s / self.steps

    @property
    def rest_per_step_s(self) -> float:
        return self.per_step_s - self.generate_per_step_s


@dataclass
class GenerateClock:
    """Wraps a model's ``generate``: forces the full completion length and adds up the wall time."""

    new_tokens: int
    seconds: float = 0.0
    calls: int = 0

    def install(self, model: Any) -> None:
        inner = model.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            kwargs["min_new_tokens"] = self.new_tokens  # EOS masked until the budget is spent: equal lengths
            begin = time.perf_counter()
            out = inner(*args, **kwargs)
            self.seconds += time.perf_counter() - begin
            self.calls += 1
            return out

        model.generate = generate  # an instance attribute: both trainers call model.generate on this object


def addition_prompts(n: int, seed: int = SEED) -> list[dict[str, Any]]:
    """Prompt rows ``a+b=`` with the sum as the answer (the shape of a ``prompts`` dataset row)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "meta": {}})
    return rows


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def warm_up(model_dir: Path) -> None:
    """One forward/backward and one short generate so neither contender pays torch's first-call costs."""
    model, tokenizer = load_causal_lm(str(model_dir))
    ids = tokenizer(["12+30=42"] * PROMPTS_PER_STEP * G, return_tensors="pt").input_ids
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        model.generate(
            input_ids=ids[:, :6],
            attention_mask=torch.ones_like(ids[:, :6]),
            max_new_tokens=4,
            do_sample=True,
            pad_token_id=tokenizer.pad_token_id,
        )


def run_rlrun(
    model_dir: Path,
    rows: list[dict[str, Any]],
    steps: int,
    work: Path,
    new_tokens: int,
    engine: str = "hf",
    async_rollouts: int = 0,
    old_logprobs: str = "recompute",
) -> tuple[Timing, TimedReporter]:
    spec = parse_spec(
        {
            "algorithm": "grpo",
            "model": MODEL_REF,
            "dataset_id": str(uuid.uuid4()),
            "rewards": [{"name": "numeric"}],
            "hyperparameters": {
                "engine": engine,
                "async_rollouts": async_rollouts,
                "old_logprobs": old_logprobs,
                "learning_rate": LR,
                "max_steps": steps,
                "prompts_per_step": PROMPTS_PER_STEP,
                "samples_per_prompt": G,
                "max_new_tokens": new_tokens,
                "max_prompt_length": MAX_PROMPT_LENGTH,
                "max_length": MAX_PROMPT_LENGTH + new_tokens,
                "temperature": TEMPERATURE,
                "top_p": 1.0,
                "top_k": 0,
                "kl_coef": 0.0,
                "clip_low": CLIP,
                "clip_high": CLIP,
                "ppo_epochs": 1,
                "minibatches": 1,  # one update per generation batch, as TRL here
                "dynamic_sampling": False,
                "weight_decay": 0.0,
                "warmup_steps": 0,
                "max_grad_norm": 1.0,
                "seed": SEED,
                "log_every": 1,
                "eval_every": 0,
                "checkpoint_every": 0,
                "sample_every": 0,
            },
        }
    )
    assert isinstance(spec, GroupRlSpec)
    ctx = loop_context(model_dir, work)
    loaded = load_causal_lm(str(model_dir))  # loading is outside the clock, as for TRL
    clock = GenerateClock(new_tokens)
    clock.install(loaded[0])
    sync = GenerateClock(new_tokens)  # the engine's weight syncs (seconds and calls)
    # a step that made an update logs "perf/train_s"; " steps on " is the last event before the step loop
    reporter = TimedReporter(step_key="perf/train_s", setup_ends=lambda message: " steps on " in message)
    # the loops load the policy through the session (load_trainable); the already loaded copy stands in
    with contextlib.ExitStack() as patches:
        patches.enter_context(
            mock.patch.object(session_module, "load_causal_lm", lambda _path, *args, **kwargs: loaded)
        )
        if engine == "vllm_server":
            engine_clock(patches, clock, sync, new_tokens)
        patches.callback(ctx.cleanup.close)  # what trainer.loops.LOOPS does after a run: stops its engine
        start = stamp()
        result = group_rl_loop.run_group_rl(spec, RunData(train=rows), reporter, ctx)
    assert result.status == "succeeded" and reporter.setup_end is not None
    assert sorted(reporter.step_ends) == list(range(1, steps + 1)), "a step made no update"
    timing = Timing(
        name="rlrun",
        start=start,
        setup_end=reporter.setup_end,
        step_ends=[reporter.step_ends[s] for s in range(1, steps + 1)],
        generate_s=clock.seconds,  # every generate call falls inside the timed span (no eval)
        sync_s=sync.seconds,
        completion_length=mean(reporter.series("response/length_mean")),
        reward=mean(reporter.series("reward/mean")),
        new_tokens=new_tokens,
    )
    return timing, reporter


def engine_clock(
    patches: contextlib.ExitStack, clock: GenerateClock, sync: GenerateClock, tokens: int
) -> None:
    """Time the engine process's generate calls into ``clock`` and its syncs into ``sync``, and make every
    completion ``tokens`` long (vLLM's ``min_tokens``), as ``GenerateClock`` does for HF generate."""
    from trainer.rollout import served_engine

    request = served_engine.completion_request

    def equal_lengths(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return request(*args, **kwargs) | {"min_tokens": tokens}

    def timed(inner: Any, into: GenerateClock) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            out = inner(*args, **kwargs)
            into.seconds += time.perf_counter() - begin
            into.calls += 1
            return out

        return call

    served = served_engine.ServedEngine
    patches.enter_context(mock.patch.object(served_engine, "completion_request", equal_lengths))
    patches.enter_context(mock.patch.object(served, "generate", timed(served.generate, clock)))
    patches.enter_context(mock.patch.object(served, "sync_weights", timed(served.sync_weights, sync)))


def trl_config(steps: int, work: Path, new_tokens: int) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(work / "trl-out"),
        max_steps=steps,
        num_generations=G,
        per_device_train_batch_size=PROMPTS_PER_STEP * G,  # completions per optimizer step
        gradient_accumulation_steps=1,
        steps_per_generation=1,  # one optimizer step per generation batch
        num_iterations=1,
        max_completion_length=new_tokens,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        beta=0.0,  # no KL, no reference model
        epsilon=CLIP,
        loss_type="grpo",  # per-sequence token mean, as rlrun's grpo preset
        scale_rewards="group",
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_checkpointing=False,  # TRL defaults to True; rlrun does not checkpoint
        bf16=False,  # TRL defaults to bf16; both run fp32
        fp16=False,
        use_cpu=True,
        seed=SEED,
        logging_steps=1,  # as rlrun's log_every=1
        log_completions=False,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_level="error",
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
    )


def numeric_reward(new_tokens: int) -> Any:
    """rlrun's ``numeric`` verifier as a reward function with TRL's signature."""

    def numeric_reward(
        completions: list[str], answer: list[str], prompts: list[str], **_: Any
    ) -> list[float | None]:
        return [
            numeric(
                Sample(
                    prompt=p,
                    completion=c,
                    row={"prompt": p, "answer": a, "meta": {}},
                    n_tokens=0,
                    max_new_tokens=new_tokens,
                    truncated=False,
                )
            )
            for p, c, a in zip(prompts, completions, answer, strict=True)
        ]

    return numeric_reward


def run_trl(model_dir: Path, rows: list[dict[str, Any]], steps: int, work: Path, new_tokens: int) -> Timing:
    import datasets
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    args = trl_config(steps, work, new_tokens)
    model, tokenizer = load_causal_lm(str(model_dir))
    generate_clock = GenerateClock(new_tokens)
    generate_clock.install(model)
    # An all-empty ``meta`` struct is not an Arrow type; TRL's reward function needs only prompt and answer.
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    clock = trl_step_clock()
    start = stamp()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[numeric_reward(new_tokens)],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)  # disable_tqdm swaps the progress bar for printed logs
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    assert clock.first_begin is not None and len(clock.ends) == steps and len(logs) == steps
    assert generate_clock.calls == steps, f"{generate_clock.calls} generate calls for {steps} steps"
    return Timing(
        name="TRL",
        start=start,
        setup_end=clock.first_begin,
        step_ends=clock.ends,
        generate_s=generate_clock.seconds,
        completion_length=mean([float(e["completions/mean_length"]) for e in logs]),
        reward=mean([float(e["reward"]) for e in logs]),
        new_tokens=new_tokens,
    )


def mean_of(runs: list[Timing], value: Any) -> float:
    return mean([value(r) for r in runs])


def print_table(results: list[Timing]) -> None:
    """Every run, then per completion budget the ratios of the contenders' means over the rounds."""
    header = (
        f"{'':8}{'new tok':>8}{'steps':>7}{'setup s':>10}{'total s':>10}{'s/step':>10}{'steady s/step':>15}"
    )
    header += f"{'cpu s/step':>12}{'generate s/step':>17}{'rest s/step':>13}"
    header += f"{'compl len':>11}{'reward':>8}{'load':>6}"
    print(header)
    for r in results:
        row = f"{r.name:8}{r.new_tokens:>8}{r.steps:>7}{r.setup_s:>10.2f}{r.total_s:>10.2f}"
        row += f"{r.per_step_s:>10.4f}"
        row += f"{r.steady_s:>15.4f}{r.cpu_per_step_s:>12.4f}{r.generate_per_step_s:>17.4f}"
        row += f"{r.rest_per_step_s:>13.4f}{r.completion_length:>11.2f}{r.reward:>8.3f}{r.load:>6.2f}"
        print(row)
    for tokens in dict.fromkeys(r.new_tokens for r in results):
        ours = [r for r in results if r.new_tokens == tokens and r.name == "rlrun"]
        trl = [r for r in results if r.new_tokens == tokens and r.name == "TRL"]

        def ratio(value: Any, ours: list[Timing] = ours, trl: list[Timing] = trl) -> float:
            return mean_of(trl, value) / mean_of(ours, value)

        print(
            f"ratio TRL / rlrun at {tokens} new tokens (means of {len(ours)} runs each): "
            f"s/step {ratio(lambda r: r.per_step_s):.2f}, steady {ratio(lambda r: r.steady_s):.2f}, "
            f"cpu {ratio(lambda r: r.cpu_per_step_s):.2f}, "
            f"generate {ratio(lambda r: r.generate_per_step_s):.2f}, "
            f"rest {ratio(lambda r: r.rest_per_step_s):.2f}  (goal >= 1.5)"
        )


def print_split(reporter: TimedReporter, ours: Timing) -> None:
    gen_s, train_s = mean(reporter.series("perf/gen_s")), mean(reporter.series("perf/train_s"))
    other = ours.per_step_s - gen_s - train_s
    print(
        f"rlrun split per step at {ours.new_tokens} new tokens (its perf/* metrics, mean over {ours.steps} "
        f"steps): gen {gen_s:.4f} s (of which generate() {ours.generate_per_step_s:.4f} s) + "
        f"train {train_s:.4f} s + other {other:.4f} s (setup, metrics; spread over the steps) "
        f"= {ours.per_step_s:.4f} s; gen is {gen_s / (gen_s + train_s):.0%} of gen+train"
        + (f"; the engine's weight sync {ours.sync_s / ours.steps:.4f} s/step" if ours.sync_s else "")
    )


def main(argv: list[str] | None = None) -> None:
    global PROMPTS_PER_STEP, G, MODEL_REF  # --shape and --model-folder set them for both contenders
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps for each trainer")
    parser.add_argument(
        "--new-tokens", default=",".join(map(str, NEW_TOKENS)), help="completion budgets, comma-separated"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="runs of each contender per budget, in the order AB BA AB ..."
    )
    parser.add_argument(
        "--engine", default="hf", choices=["hf", "vllm_server"], help="rlrun's rollout engine"
    )
    parser.add_argument(
        "--shape", default=f"{PROMPTS_PER_STEP}x{G}", help="prompts per step x completions each"
    )
    parser.add_argument(
        "--async-rollouts",
        type=int,
        default=0,
        choices=[0, 1],
        help="rlrun generates the next step's rollouts during this step's update (--engine vllm_server)",
    )
    parser.add_argument(
        "--model-folder",
        default=None,
        help="an HF model folder (e.g. an imported SmolLM2-135M-Instruct) instead of tiny:" + PRESET,
    )
    parser.add_argument(
        "--old-logprobs",
        default="recompute",
        choices=["recompute", "sampler"],
        help="rlrun's old_logprobs (sampler: the engine's log-probs, no no-grad pass; --engine vllm_server)",
    )
    args = parser.parse_args(argv)
    if args.old_logprobs == "sampler" and args.engine != "vllm_server":
        parser.error("--old-logprobs sampler needs --engine vllm_server")
    if args.async_rollouts and args.engine != "vllm_server":
        parser.error("--async-rollouts needs --engine vllm_server")
    PROMPTS_PER_STEP, G = (int(v) for v in args.shape.split("x"))
    budgets = [int(t) for t in args.new_tokens.split(",")]
    if args.steps < 1 or args.rounds < 1 or min(budgets) < 1:
        parser.error("--steps, --rounds and every --new-tokens must be at least 1")
    quiet()
    import transformers
    import trl

    print(f"command: cd {shlex.quote(os.getcwd())} && {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}, trl {trl.__version__}; {args.model_folder or MODEL_REF}, "
        f"{N_PROMPTS} prompts, {PROMPTS_PER_STEP} prompts x G={G} x {budgets} new tokens per step, "
        f"rlrun engine {args.engine}{' with async_rollouts 1' if args.async_rollouts else ''}, "
        f"old_logprobs {args.old_logprobs}, "
        f"temperature {TEMPERATURE}, lr {LR}, no KL, clip {CLIP}, fp32, cpu; "
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus"
    )
    rows = addition_prompts(N_PROMPTS)
    results: list[Timing] = []
    splits: list[tuple[TimedReporter, Timing]] = []
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-") as tmp:
        work = Path(tmp)
        if args.model_folder:
            model_dir = Path(args.model_folder).resolve()
            MODEL_REF = str(model_dir)
        else:
            model_dir = tiny_model_dir(PRESET, work / "cache")
        warm_up(model_dir)
        for tokens in budgets:
            for round_ in range(args.rounds):
                # Whoever runs first in a process runs slower (allocator and page first touches: measured
                # 0.84 with rlrun first, 1.04 with TRL first), so the order alternates: AB, BA, ...
                order = ("rlrun", "TRL") if round_ % 2 == 0 else ("TRL", "rlrun")
                for name in order:
                    torch.manual_seed(SEED)
                    out = work / f"{tokens}-{round_}-{name}"
                    if name == "rlrun":
                        ours, reporter = run_rlrun(
                            model_dir,
                            rows,
                            args.steps,
                            out,
                            tokens,
                            args.engine,
                            args.async_rollouts,
                            args.old_logprobs,
                        )
                        results.append(ours)
                        splits.append((reporter, ours))
                    else:
                        results.append(run_trl(model_dir, rows, args.steps, out, tokens))
                    gc.collect()
    print_table(results)
    for reporter, ours in splits:
        print_split(reporter, ours)
    print(f"load average after the runs: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus")
    print(
        "note: with one epoch over one minibatch both use the update's own detached log-probs as the old "
        "policy's (no extra no-grad pass); both compute logits only over the completion positions "
        "(logits_to_keep). Both generate with transformers' generate()."
    )
    print(
        "note: TRL's split is not reported by TRL itself; its generate s/step comes from the same wrapper "
        "around model.generate as rlrun's. Completion lengths are forced to the full budget in both."
    )


if __name__ == "__main__":
    main()
