"""Do the two rollout engines sample the same distribution? The engine process (``vllm_server``) against the
transformers engine (``hf``), same weights, same prompts, same settings.

Both engines promise samples from the policy's tempered distribution ``softmax(logits / T)`` (no top-k,
top-p 1, no penalties) until EOS or ``--max-new-tokens``. If they keep it, statistics of their samples agree
within sampling noise. Per engine this prints, over ``--prompts`` prompts x ``--samples`` each:
- mean completion length and the fraction cut at the cap, with standard errors;
- the mean per-token negative log-likelihood of the samples under the model at ``T`` (computed here by the
  trainer's forward pass, the same for both engines): sampling from a flatter or sharper distribution than
  promised moves it;
- the first token's distribution against the model's (total variation distance of the empirical
  first-token frequencies from ``softmax(logits / T)``, pooled over prompts), with what the same count
  of exact draws gives (a multinomial draw from the model's own probabilities, ``--reference-draws`` times).

Then ``z = (a - b) / sqrt(se_a^2 + se_b^2)`` for length and NLL: |z| above ~3 means the engines differ.

Prompts: the real-model bench's word problems (rlrun/word_problems.py) in the model's chat template, from
``--model-folder`` (an imported model, e.g. SmolLM2-135M-Instruct: ``rlrun models import
smollm2-135m-instruct``) or the ``tiny:llama-10m`` preset on plain-text prompts (no folder given).

Needs the engine environment (``make engine``). Run: ``.venv/bin/python bench/sampler_parity.py
--model-folder <folder> [--prompts 64 --samples 8 --max-new-tokens 64 --temperature 1.0]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import engine_python_or_none  # a sibling module: python puts bench/ first on sys.path

from rlrun.word_problems import problems
from trainer.data.prompts import render_prompt
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.rollout.base import Completion, SamplingParams
from trainer.rollout.engine_process import EngineOptions, EngineProcess
from trainer.rollout.hf_engine import HFEngine
from trainer.rollout.served_engine import ServedEngine


def mean_se(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


@torch.no_grad()
def nll_per_token(model: Any, completions: list[Completion], temperature: float) -> list[float]:
    """Mean ``-log softmax(logits / T)[token]`` of each completion's tokens under ``model``."""
    out = []
    for c in completions:
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1].float() / temperature
        logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        out.append(-logp.mean().item())
    return out


@torch.no_grad()
def first_token_probs(model: Any, prompts: list[list[int]], temperature: float) -> list[torch.Tensor]:
    return [torch.softmax(model(torch.tensor([p])).logits[0, -1].float() / temperature, -1) for p in prompts]


def first_token_tv(completions: list[Completion], probs: list[torch.Tensor], samples: int) -> float:
    """Total variation between each prompt's empirical first-token frequencies and its model
    probabilities, averaged over prompts."""
    distances = []
    for i, p in enumerate(probs):
        counts = torch.zeros_like(p)
        for c in completions:
            if c.prompt_index == i:
                counts[c.token_ids[0]] += 1
        distances.append(0.5 * (counts / samples - p).abs().sum().item())
    return statistics.fmean(distances)


def reference_tv(probs: list[torch.Tensor], samples: int, draws: int, seed: int) -> tuple[float, float]:
    """Mean and spread of ``first_token_tv`` for exact multinomial draws of the same size."""
    generator = torch.Generator().manual_seed(seed)
    values = []
    for _ in range(draws):
        distances = []
        for p in probs:
            counts = torch.bincount(
                torch.multinomial(p, samples, True, generator=generator), minlength=len(p)
            )
            distances.append(0.5 * (counts / samples - p).abs().sum().item())
        values.append(statistics.fmean(distances))
    return statistics.fmean(values), statistics.stdev(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-folder", type=Path, help="an imported model folder (default: tiny:llama-10m)"
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--reference-draws", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    python = engine_python_or_none()
    if python is None:
        return
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-parity-") as tmp:
        folder = args.model_folder or tiny_model_dir("llama-10m", Path(tmp) / "cache")
        model, tokenizer = load_causal_lm(str(folder))
        model.eval()
        if args.model_folder is not None:
            _, rows = problems(args.seed, args.prompts, 0)
            prompts = [tokenizer(render_prompt(r["prompt"], tokenizer)).input_ids for r in rows]
        else:
            prompts = [tokenizer(f"{a}+{a * 7 % 50}=")["input_ids"] for a in range(args.prompts)]
        print(
            f"{folder}, fp32, {len(prompts)} prompts x {args.samples} samples, T {args.temperature}, "
            f"{args.max_new_tokens} new tokens; torch {torch.__version__}, load {os.getloadavg()[0]:.2f}"
        )
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
        longest = max(len(p) for p in prompts) + args.max_new_tokens
        options = EngineOptions(
            model_dir=folder, max_model_len=longest, threads=torch.get_num_threads(), seed=args.seed
        )
        samples: dict[str, list[Completion]] = {}
        with EngineProcess(options, log_path=Path(tmp) / "engine.log", python=python) as process:
            served = ServedEngine(process.base_url, max_model_len=longest)
            start = time.perf_counter()
            samples["vllm_server"] = served.generate(prompts, args.samples, params)
            print(f"vllm_server: {time.perf_counter() - start:.0f} s")
            served.close()
        start = time.perf_counter()
        samples["hf"] = HFEngine(model, tokenizer).generate(
            prompts, args.samples, dataclasses.replace(params, seed=args.seed)
        )
        print(f"hf: {time.perf_counter() - start:.0f} s")
        probs = first_token_probs(model, prompts, args.temperature)
        ref, ref_sd = reference_tv(probs, args.samples, args.reference_draws, args.seed)
        stats = {}
        print(f"{'engine':<12} {'length':>14} {'cut at cap':>14} {'NLL/token':>16} {'first-token TV':>15}")
        for name, done in samples.items():
            length = mean_se([float(len(c.token_ids)) for c in done])
            cut = mean_se([float(c.finish_reason == "length") for c in done])
            nll = mean_se(nll_per_token(model, done, args.temperature))
            tv = first_token_tv(done, probs, args.samples)
            stats[name] = (length, nll)
            print(
                f"{name:<12} {length[0]:>7.1f} ± {length[1]:<4.1f} {cut[0]:>7.1%} ± {cut[1]:<5.1%} "
                f"{nll[0]:>8.3f} ± {nll[1]:<5.3f} {tv:>15.3f}"
            )
        print(f"{'exact draws':<12} {'':>14} {'':>14} {'':>16} {ref:>9.3f} ± {ref_sd:.3f}")
        (la, na), (lb, nb) = stats["vllm_server"], stats["hf"]
        z_length = (la[0] - lb[0]) / math.hypot(la[1], lb[1])
        z_nll = (na[0] - nb[0]) / math.hypot(na[1], nb[1])
        print(f"z (vllm_server - hf): length {z_length:+.2f}, NLL/token {z_nll:+.2f}")


if __name__ == "__main__":
    main()
