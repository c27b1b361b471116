"""Chat serving speed: rlrun's ``/v1/chat/completions`` against plain ``transformers`` generate in a loop.

rlrun: ``rlrun serve --no-worker`` (the API plus the inference process it starts) in a fresh temporary
home; ``c`` chat requests for the built-in ``tiny:llama-10m`` (random-init Llama, ~11M parameters) are sent
at once from ``c`` threads, each ``stream: true`` with ``max_tokens`` 64, temperature 1, its own seed. Per
request: time to the first content chunk (TTFT) and to the end; throughput is the completion tokens all
requests got (``usage``) over the wall time from the first send to the last answer.

Peer (the floor a user would write): the same model folder loaded with ``AutoModelForCausalLM``, the same
prompts rendered the same way, ``model.generate(max_new_tokens=64, do_sample=True)`` one request after
the other in a loop. It does not stream, so a request's TTFT is the time its answer is complete, counted
from the same start as rlrun's (request ``i`` waits for the ``i - 1`` before it).

Printed per concurrency 1, 8 and 32: tokens/s for both, ``ratio = rlrun tokens/s / transformers
tokens/s`` (above 1: rlrun serves faster) and mean/p50/max TTFT. Completion lengths differ (a random model
stops at EOS at random places); tokens/s accounts for that.

``--backends hf,vllm_server`` (the default) runs the rlrun rounds once per inference backend
(``RLRUN_INFERENCE_BACKEND``: vllm_server starts a vLLM engine process from the engine environment, `make
engine`; vllm needs a GPU environment with vLLM: scripts/gpu_vllm_inference.sh); ``--device cuda`` puts the
transformers peer on the GPU.

Second peer, with vllm_server: vLLM's own OpenAI server alone (what ``vllm serve`` runs, started the way the
backend starts it, minus LoRA: trainer/rollout/engine_process.py), sent the same prompts rendered the same
way to its ``/v1/completions`` (the tiny model has no chat template for its chat route), streamed, same
``max_tokens`` and temperature. ``vs vllm = rlrun tokens/s / vLLM's tokens/s``: what the API and the
inference process in front of the engine cost (1: nothing).

``--model-folder`` serves a model folder instead of the tiny preset (e.g. SmolLM2-135M-Instruct imported
with ``rlrun models import smollm2-135m-instruct``): the server gets its parent as a model root and the
requests name it by its folder's name; every contender loads it in its own dtype (float32 for an import).
A real chat model stops at its end of turn, so the answers' lengths differ between contenders; tokens/s
accounts for that.

Run: ``.venv/bin/python bench/inference.py [--concurrency 1,8,32] [--max-tokens 64]
[--backends hf,vllm_server] [--device cpu] [--model-folder PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch
from common import rlrun_serve  # a sibling module: bench/ is first on sys.path

MODEL = "tiny:llama-10m"
PROMPT = "What is {a} plus {b}? Answer with the number."


def serve(home: Path, backend: str, folder: Path | None) -> tuple[subprocess.Popen[bytes], str]:
    env = {"RLRUN_INFERENCE_BACKEND": backend}
    if folder is not None:  # the folder's parent is a model root: requests name the folder
        env["RLRUN_MODEL_ROOTS"] = json.dumps([str(folder.parent)])
    return rlrun_serve(home, ["--no-worker"], env)


def one_request(
    url: str, model: str, i: int, max_tokens: int, start: float, out: list[dict[str, float]]
) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT.format(a=i, b=2 * i)}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timed_stream(
        f"{url}/v1/chat/completions", body, start, out, lambda choice: choice["delta"].get("content")
    )


def timed_stream(
    url: str, body: dict[str, Any], start: float, out: list[dict[str, float]], text: Callable[[Any], Any]
) -> None:
    """Send one streamed request; append its time to the first chunk with text (``text`` of its first
    choice), its end and its completion tokens (``usage``) to ``out``."""
    first = None
    tokens = 0
    with httpx.stream("POST", url, json=body, timeout=600) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if first is None and chunk["choices"] and text(chunk["choices"][0]):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter() - start
    out.append({"ttft": first if first is not None else end, "end": end, "tokens": tokens})


def one_engine_request(
    url: str, prompt: str, max_tokens: int, start: float, out: list[dict[str, float]]
) -> None:
    """The same request sent to vLLM's own server (its ``/v1/completions``, the prompt already rendered)."""
    body = {
        "model": "policy",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timed_stream(f"{url}/v1/completions", body, start, out, lambda choice: choice.get("text"))


def engine_round(url: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    out: list[dict[str, float]] = []
    start = time.perf_counter()
    threads = [
        threading.Thread(target=one_engine_request, args=(url, p, max_tokens, start, out)) for p in prompts
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summary(out, max(r["end"] for r in out))


def vllm_rounds(folder: str, levels: list[int], max_tokens: int) -> dict[int, dict[str, Any]]:
    """vLLM's own server on ``folder``, alone: one round per concurrency level."""
    from transformers import AutoTokenizer

    from trainer.data.prompts import render_prompt
    from trainer.inference.engine_served import dtype_of, max_context_of
    from trainer.rollout.engine_process import EngineOptions, EngineProcess

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [
        render_prompt([{"role": "user", "content": PROMPT.format(a=i, b=2 * i)}], tokenizer)
        for i in range(max(levels))
    ]
    options = EngineOptions(  # as the backend starts its engines, minus LoRA
        model_dir=Path(folder),
        dtype=dtype_of(folder),
        max_model_len=max_context_of(folder, 4096),
        logprobs_mode="raw_logprobs",
        threads=os.cpu_count() or 1,
    )
    with EngineProcess(options) as engine:
        for c in levels:  # warm-up, as rlrun's rounds
            engine_round(engine.base_url, prompts[:c], max_tokens)
        return {c: engine_round(engine.base_url, prompts[:c], max_tokens) for c in levels}


def rlrun_round(url: str, model: str, concurrency: int, max_tokens: int) -> dict[str, Any]:
    out: list[dict[str, float]] = []
    start = time.perf_counter()
    threads = [
        threading.Thread(target=one_request, args=(url, model, i, max_tokens, start, out))
        for i in range(concurrency)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r["end"] for r in out)
    return summary(out, wall)


def transformers_round(folder: str, concurrency: int, max_tokens: int, device: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.data.prompts import render_prompt

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval().to(device)
    out: list[dict[str, float]] = []
    start = time.perf_counter()
    for i in range(concurrency):
        text = render_prompt([{"role": "user", "content": PROMPT.format(a=i, b=2 * i)}], tokenizer)
        ids = torch.tensor([tokenizer(text).input_ids], device=device)
        torch.manual_seed(i)
        with torch.no_grad():
            seq = model.generate(
                ids,
                max_new_tokens=max_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )[0, ids.shape[1] :].tolist()
        tokens = seq.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in seq else len(seq)
        done = time.perf_counter() - start
        out.append({"ttft": done, "end": done, "tokens": tokens})
    return summary(out, time.perf_counter() - start)


def summary(out: list[dict[str, float]], wall: float) -> dict[str, Any]:
    ttfts = [r["ttft"] for r in out]
    tokens = sum(r["tokens"] for r in out)
    return {
        "tokens": tokens,
        "wall": wall,
        "tps": tokens / wall,
        "ttft_mean": statistics.mean(ttfts),
        "ttft_p50": statistics.median(ttfts),
        "ttft_max": max(ttfts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--backends",
        default="hf,vllm_server",
        help="rlrun inference backends, comma-separated (hf, vllm_server, vllm)",
    )
    parser.add_argument("--device", default="cpu", help="the transformers peer's device")
    parser.add_argument(
        "--model-folder", type=Path, default=None, help=f"a model folder to serve (default: {MODEL})"
    )
    args = parser.parse_args()
    folder_arg: Path | None = args.model_folder.resolve() if args.model_folder else None
    model = folder_arg.name if folder_arg is not None else MODEL
    backends = args.backends.split(",")
    os.environ.setdefault("TQDM_DISABLE", "1")
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {folder_arg or MODEL}, "
        f"max_tokens {args.max_tokens}"
    )
    with tempfile.TemporaryDirectory(prefix="rlrun-inference-bench-") as tmp:
        home = Path(tmp)
        ours: dict[str, dict[int, dict[str, Any]]] = {}
        for backend in backends:
            proc, url = serve(home, backend, folder_arg)
            try:
                rlrun_round(url, model, 1, 4)  # warm-up: the inference process loads the model
                for c in levels:  # and one unmeasured round per level (vLLM's CPU kernels warm per shape)
                    rlrun_round(url, model, c, args.max_tokens)
                ours[backend] = {c: rlrun_round(url, model, c, args.max_tokens) for c in levels}
            finally:
                proc.terminate()
                proc.wait(30)
        folder = str(folder_arg or next((home / "cache" / "tiny").glob(MODEL.removeprefix("tiny:"))))
        transformers_round(folder, 1, 4, args.device)  # warm-up
        peer = {c: transformers_round(folder, c, args.max_tokens, args.device) for c in levels}
        engine = vllm_rounds(folder, levels, args.max_tokens) if "vllm_server" in backends else {}
    print(
        f"{'backend':>11} | {'concurrent':>10} | {'rlrun tok/s':>11} | {'transformers tok/s':>18} | "
        f"{'ratio':>5} | {'vLLM tok/s':>10} | {'vs vllm':>7} | {'rlrun TTFT mean/p50/max s':>26} | "
        f"{'transformers TTFT mean/p50/max s':>33} | {'vLLM TTFT mean/p50/max s':>25}"
    )
    for backend in backends:
        for c in levels:
            a, b, v = ours[backend][c], peer[c], engine.get(c)
            ratio = a["tps"] / b["tps"]
            vs_vllm = f"{v['tps']:>10.1f} | {a['tps'] / v['tps']:>7.2f}" if v else f"{'-':>10} | {'-':>7}"
            vllm_ttft = f"{v['ttft_mean']:>7.2f} {v['ttft_p50']:>7.2f} {v['ttft_max']:>7.2f}" if v else "-"
            print(
                f"{backend:>11} | {c:>10} | {a['tps']:>11.1f} | {b['tps']:>18.1f} | {ratio:>5.2f} | "
                f"{vs_vllm} | "
                f"{a['ttft_mean']:>8.2f} {a['ttft_p50']:>8.2f} {a['ttft_max']:>8.2f} | "
                f"{b['ttft_mean']:>10.2f} {b['ttft_p50']:>10.2f} {b['ttft_max']:>10.2f} | {vllm_ttft}"
            )
    print("(transformers' TTFT is the time its whole answer is ready: it does not stream)")


if __name__ == "__main__":
    main()
