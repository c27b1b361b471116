"""Rollout generation: the engine process (``engine: vllm_server``, vLLM from ``.venv-engine``) against the
transformers engine (``engine: hf``), same weights, same prompts, side by side.

Both are rlrun's own ``RolloutEngine`` objects, called as the online-RL loops call them: ``ServedEngine``
over an ``EngineProcess`` on the ``tiny:llama-10m`` preset (fp32, the policy's dtype) and ``HFEngine`` on
the same model loaded in this process. Per shape (prompts x samples x new tokens), each engine generates
``--rounds`` times after one warm-up call; sampling at temperature 1 with EOS left on, so completion
lengths differ between calls: throughput counts the tokens actually generated.

Printed per shape: tokens/s of each, ``ratio = engine / hf`` (above 1: the engine is faster) and the
engine's weight sync (``sync_weights``: write safetensors to /dev/shm + ``reload_weights`` + prefix-cache
reset), which a run pays once per step on top of generating, beside the same sync through ``rlrun engine
--remote``'s front on loopback (trainer/rollout/engine_front.py: the weights streamed over HTTP to the front,
which checks the file and has the engine reload it from its own folder: what a worker on another host pays,
less the network). The engine's start-up (``make engine`` built once; about 8 s to answer here) is printed
but not in the ratios: a run pays it once.

vLLM's CPU backend pins its OpenMP threads and by default keeps one core for its front end
(``reserve_cpu_num=1`` in the engine log): on a 2-core machine that leaves the model one core. The engine
here gets this process's thread count, the whole machine, so ``EngineOptions`` binds it to every core
(``VLLM_CPU_OMP_THREADS_BIND``, which also passes through from the environment to compare).

Needs the engine environment: ``make engine``. Run: ``.venv/bin/python bench/engine_rollouts.py
[--shapes 8x4x16,16x8x64,32x1x128] [--rounds 3] [--model-folder FOLDER]`` (default: the preset; e.g. an
imported SmolLM2-135M folder for a real model's sync sizes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import engine_python_or_none  # a sibling module: python puts bench/ first on sys.path

from trainer.models import load_causal_lm, tiny_model_dir
from trainer.rollout.base import RolloutEngine, SamplingParams
from trainer.rollout.engine_front import EngineFront
from trainer.rollout.engine_process import EngineOptions, EngineProcess
from trainer.rollout.hf_engine import HFEngine
from trainer.rollout.served_engine import ServedEngine

PRESET = "llama-10m"


def parse_shape(text: str) -> tuple[int, int, int]:
    prompts, samples, tokens = (int(x) for x in text.split("x"))
    return prompts, samples, tokens


def tokens_per_s(
    engine: RolloutEngine, prompts: list[list[int]], n: int, new_tokens: int, rounds: int
) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    engine.generate(prompts, n, params)  # warm-up
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = engine.generate(prompts, n, params)
        rates.append(sum(len(c.token_ids) for c in out) / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x4x16,16x8x64,32x1x128", help="prompts x samples x new tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-folder", default=None, help="an HF model folder instead of the preset")
    args = parser.parse_args()
    python = engine_python_or_none()
    if python is None:
        return
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    longest = max(tokens for _, _, tokens in shapes)
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(
        f"{args.model_folder or 'tiny:' + PRESET}, fp32, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), "
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus"
    )
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-engine-") as tmp:
        folder = Path(args.model_folder) if args.model_folder else tiny_model_dir(PRESET, Path(tmp) / "cache")
        model, tokenizer = load_causal_lm(str(folder))
        model.eval()
        hf = HFEngine(model, tokenizer)
        options = EngineOptions(model_dir=folder, max_model_len=64 + longest, threads=torch.get_num_threads())
        started = time.perf_counter()
        with EngineProcess(options, log_path=Path(tmp) / "engine.log", python=python) as process:
            print(f"engine answering after {time.perf_counter() - started:.1f} s")
            served = ServedEngine(process.base_url, max_model_len=options.max_model_len)
            syncs = []
            for _ in range(5):
                start = time.perf_counter()
                served.sync_weights(model)
                syncs.append(time.perf_counter() - start)
            uploads = Path(tmp) / "front-uploads"
            uploads.mkdir()
            front = EngineFront(process.base_url, "bench", uploads, host="127.0.0.1")
            remote = ServedEngine(
                f"http://127.0.0.1:{front.port}",
                max_model_len=options.max_model_len,
                token="bench",
                upload=True,
            )
            uploaded = []
            for _ in range(5):
                start = time.perf_counter()
                remote.sync_weights(model)
                uploaded.append(time.perf_counter() - start)
            remote.close()
            front.close()
            size = (served.weights_dir / "model.safetensors").stat().st_size / 1e6
            files, upload = statistics.median(syncs), statistics.median(uploaded)
            print(
                f"sync_weights of {size:.0f} MB, median over 5: files in /dev/shm {files * 1000:.0f} ms, "
                f"uploaded through the front {upload * 1000:.0f} ms ({upload / files:.2f}x)"
            )
            print(f"{'shape (P x G x T)':<18} {'engine tok/s':>12} {'hf tok/s':>10} {'ratio':>7}")
            for p, g, t in shapes:
                prompts = [tokenizer(f"{a}+{a * 7 % 50}=")["input_ids"] for a in range(p)]
                engine_rate = tokens_per_s(served, prompts, g, t, args.rounds)
                hf_rate = tokens_per_s(hf, prompts, g, t, args.rounds)
                shape, ratio = f"{p} x {g} x {t}", engine_rate / hf_rate
                print(f"{shape:<18} {engine_rate:>12.0f} {hf_rate:>10.0f} {ratio:>7.2f}")
            served.close()


if __name__ == "__main__":
    main()
