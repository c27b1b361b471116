"""What each of the 2 gloo ranks of test_safetensors_stream's sharded test runs (module level: a forked rank
imports it by name, so not in the test file)."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_model

from trainer.distributed import Ranks, wrap
from trainer.models import build_tiny_tokenizer, tiny_config
from trainer.rollout.safetensors_stream import SafetensorsStream, tied_names


def tied_tiny_model() -> torch.nn.Module:
    """tiny:llama-0.4m with its LM head tied to its embedding (as SmolLM2's), the same on every rank."""
    from transformers import LlamaForCausalLM

    config = tiny_config("llama-0.4m", build_tiny_tokenizer())
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # an odd vocabulary row count, so the shards of the embedding differ in size
        model.model.norm.weight.uniform_(0.5, 1.5)
    return model


def stream_on_rank(rank: int, store: str, out: str, backend: str = "gloo") -> None:
    """Rank ``rank`` of 2: shard the model (FSDP2), then stream its state as a host's first rank (rank 0 in
    the one-host case; both ranks when each is a host's first) or join the gathers only (rank 1), writing
    what it streamed to ``out/rank<N>-<case>.safetensors``. Each case ends with a collective that compares
    a number all ranks hold, so ranks whose gathers fell out of step fail (or time out) instead of passing.
    ``backend`` ``nccl``: on GPU ``rank`` (tests/loops/test_gpu.py), the gathers on the GPUs."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        model = tied_tiny_model()
        if rank == 0:
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / "model.safetensors"
                save_model(model, str(path))
                (Path(out) / "expected.safetensors").write_bytes(path.read_bytes())
        if backend == "nccl":
            model = model.to(f"cuda:{rank}")
        model = wrap(model, Ranks(rank, 2, "fsdp"))
        assert any(isinstance(t, torch.distributed.tensor.DTensor) for t in model.state_dict().values())

        def check_in_step(case: str) -> None:
            mark = torch.tensor([float(len(case))], device="cuda" if backend == "nccl" else "cpu")
            dist.all_reduce(mark)
            assert mark.item() == 2 * len(case), case

        # one host: its first rank sends, the other joins every gather
        stream = SafetensorsStream(model.state_dict(), shared=tied_names(model), block=4096)
        if rank == 0:
            (Path(out) / "rank0-one-host.safetensors").write_bytes(b"".join(stream))
        stream.gather_rest()
        check_in_step("one host")

        # two hosts: each rank is its host's first and sends the same whole file
        stream = SafetensorsStream(model.state_dict(), shared=tied_names(model), block=4096)
        (Path(out) / f"rank{rank}-two-hosts.safetensors").write_bytes(b"".join(stream))
        stream.gather_rest()  # nothing left
        check_in_step("two hosts")
        try:
            next(iter(stream))
        except RuntimeError as exc:
            assert "read once" in str(exc)
        else:
            raise AssertionError("a collective stream was read twice")

        # a send cut short (the engine failed mid-upload): the rest of the gathers are joined all the same
        stream = SafetensorsStream(model.state_dict(), shared=tied_names(model), block=4096)
        if rank == 0:
            blocks = iter(stream)
            for _ in range(3):
                next(blocks)
        stream.gather_rest()
        check_in_step("cut short")

        try:
            SafetensorsStream(model.state_dict())
        except ValueError as exc:
            assert "tied names" in str(exc)
        else:
            raise AssertionError("sharded tensors were streamed without their tied names")
        (Path(out) / f"rank{rank}.done").write_text(str(os.getpid()))
    finally:
        dist.destroy_process_group()


def adapter_tiny_model() -> torch.nn.Module:
    """tiny:llama-0.4m with a rank-4 LoRA on its attention projections, B drawn (not peft's zeros) so the
    merge moves the weights; the same on every rank."""
    from transformers import LlamaForCausalLM

    from trainer.adapters import add_adapter
    from trainer.specs import AdapterSpec

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama-0.4m", build_tiny_tokenizer()))
    model = add_adapter(model, AdapterSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"]), "causal")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model


def adapter_on_rank(rank: int, store: str, out: str) -> None:
    """Rank ``rank`` of 2: shard an adapter model (FSDP2), then write what a sync sends from it: the merged
    weights streamed (``merged.safetensors``, rank 0; rank 1 joins the gathers) and the adapter saved from
    its gathered LoRA tensors (``adapter/``, rank 0); rank 0 first writes the same from the unsharded model
    (``expected-merged.safetensors``, ``expected-adapter/``). Then a LoRA on the embedding, sharded, is
    refused by ``merged_stream``."""
    from trainer.adapters import merged_state_dict
    from trainer.rollout.weight_streams import gathered_adapter_state, merged_stream

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        model = adapter_tiny_model()
        if rank == 0:
            (Path(out) / "expected-merged.safetensors").write_bytes(
                b"".join(SafetensorsStream(merged_state_dict(model)))
            )
            model.save_pretrained(str(Path(out) / "expected-adapter"))
        model = wrap(model, Ranks(rank, 2, "fsdp"))
        stream = merged_stream(model)
        if rank == 0:
            (Path(out) / "merged.safetensors").write_bytes(b"".join(stream))
        stream.gather_rest()
        state = gathered_adapter_state(model)
        if rank == 0:
            model.save_pretrained(str(Path(out) / "adapter"), state_dict=state)
        mark = torch.tensor([1.0])
        dist.all_reduce(mark)  # the ranks' collectives in step
        assert mark.item() == 2

        # a LoRA on the embedding cannot be merged from shards: refused, naming the layer, before any gather
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        plain = LlamaForCausalLM(tiny_config("llama-0.4m", build_tiny_tokenizer()))
        embedding = get_peft_model(plain, LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]))
        embedding = wrap(embedding, Ranks(rank, 2, "fsdp"))
        try:
            merged_stream(embedding)
        except NotImplementedError as exc:
            assert "layer model.embed_tokens (Embedding)" in str(exc), exc
        else:
            raise AssertionError("a sharded LoRA on the embedding was streamed")
        (Path(out) / f"rank{rank}.done").write_text(str(os.getpid()))
    finally:
        dist.destroy_process_group()
