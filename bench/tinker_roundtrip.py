"""The cost of training over HTTP: one ``forward_backward`` + ``optim_step`` round trip through the official
`tinker` SDK against rlrun, against the same work done in-process.

rlrun: ``rlrun serve --no-inference`` (API and one worker, SQLite) in a fresh temporary home; the SDK
(``TINKER_BASE_URL``) creates a rank-8 LoRA training client on ``--model``, then each round submits
``forward_backward`` (cross_entropy on ``--batch`` datums of ``--tokens`` tokens) and ``optim_step``
pipelined, as its docs do, and waits for both results.

Peer: the same model and adapter loaded in this process and the same two calls made directly
(trainer/loops/training_session.py's ``forward_backward`` and ``optim_step`` on parsed datums): the
work without HTTP, the API's proxy, the worker's queue and the futures' polling.

Printed: median and p90 seconds per round for both after ``--warmup`` rounds, and ``overhead =
rlrun / in-process`` (1: no cost). Run: ``.venv/bin/python bench/tinker_roundtrip.py [--rounds 20]
[--batch 8] [--tokens 64] [--model tiny:llama-10m]`` (a tiny preset).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import rlrun_serve


def preset_folder(model: str, cache: Path) -> str:
    """A tiny preset's folder (built once); the bench compares on presets only."""
    from trainer.models import tiny_model_dir

    if not model.startswith("tiny:"):
        raise SystemExit("--model must be a tiny preset (tiny:llama-10m, ...)")
    return str(tiny_model_dir(model.removeprefix("tiny:"), cache))


def batch(batch_size: int, tokens: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (tokens + 1,), generator=g).tolist() for _ in range(batch_size)]


def rlrun_rounds(url: str, model: str, seqs: list[list[int]], rounds: int) -> list[float]:
    import tinker
    from tinker import types

    os.environ |= {"TINKER_BASE_URL": url, "TINKER_API_KEY": "tml-bench", "TINKER_TELEMETRY": "0"}
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=model, rank=8).result()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
        )
        for s in seqs
    ]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fb = training.forward_backward(data, loss_fn="cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result()
        step.result()
        times.append(time.perf_counter() - t0)
    service.close("success")
    return times


def in_process_rounds(model_ref: str, cache: Path, seqs: list[list[int]], rounds: int) -> list[float]:
    from trainer.adapters import add_adapter
    from trainer.loops.training_session import ADAM_DEFAULTS, forward_backward, optim_step
    from trainer.models import load_causal_lm
    from trainer.primitives.wire import Datum, ForwardBackwardRequest
    from trainer.specs import AdapterSpec

    model, _ = load_causal_lm(preset_folder(model_ref, cache))
    model = add_adapter(model, AdapterSpec(r=8, alpha=8), "causal")
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    data = [
        Datum(tokens=s[:-1], inputs={"target_tokens": torch.tensor(s[1:]), "weights": torch.ones(len(s) - 1)})
        for s in seqs
    ]
    request = ForwardBackwardRequest("m", 1, data, "cross_entropy", {}, forward_only=False)
    params = dict(ADAM_DEFAULTS)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        forward_backward(model, request, None, torch.device("cpu"))
        optim_step(model, optimizer, params)
        times.append(time.perf_counter() - t0)
    return times


def stats(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", default="tiny:llama-10m")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        proc, url = rlrun_serve(home, ["--no-inference"])
        try:
            from trainer.models import load_causal_lm

            vocab = int(load_causal_lm(preset_folder(args.model, home / "cache"))[0].config.vocab_size)
            seqs = batch(args.batch, args.tokens, vocab)
            remote = rlrun_rounds(url, args.model, seqs, args.warmup + args.rounds)[args.warmup :]
        finally:
            proc.terminate()
            proc.wait(60)
        local = in_process_rounds(args.model, home / "cache", seqs, args.warmup + args.rounds)[args.warmup :]
    r, loc = stats(remote), stats(local)
    rows: list[tuple[str, Any, Any]] = [
        ("median s/round", f"{r['median']:.3f}", f"{loc['median']:.3f}"),
        ("p90 s/round", f"{r['p90']:.3f}", f"{loc['p90']:.3f}"),
    ]
    print(
        f"{args.model}, batch {args.batch} x {args.tokens} tokens, {args.rounds} rounds after {args.warmup}"
    )
    print(f"{'':16} {'rlrun (SDK)':>12} {'in-process':>12}")
    for name, a, b in rows:
        print(f"{name:16} {a:>12} {b:>12}")
    print(f"overhead (rlrun / in-process, median): {r['median'] / loc['median']:.2f}x")


if __name__ == "__main__":
    main()
