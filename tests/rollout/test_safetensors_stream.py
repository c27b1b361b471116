"""The upload body made from tensors (trainer/rollout/safetensors_stream.py), read back by safetensors' own
loader (its Rust parser checks the header and that the offsets tile the data exactly) and by the front's
check, against what ``save_file`` / ``save_model`` write for the same tensors; a sharded model (FSDP2 on 2
gloo ranks) streamed a parameter at a time gives the same file."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, save, save_model
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.rollout.engine_front import check_safetensors
from trainer.rollout.safetensors_stream import SafetensorsStream, tied_names


def mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(5, 3, generator=g),
        "half": torch.randn(4, generator=g).to(torch.bfloat16),
        "ids": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.zeros(0, 4),
        "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # not contiguous
        "a_wide": torch.arange(3, dtype=torch.float64),  # first in the file, though not by name
        "fp8": torch.ones(5).to(torch.float8_e4m3fn),
        "small": torch.arange(3, dtype=torch.int8),
    }


@pytest.mark.parametrize("block", [1 << 20, 7])
def test_the_stream_is_a_safetensors_file_of_the_tensors_in_blocks_of_at_most_the_size(block: int) -> None:
    tensors = mixed()
    stream = SafetensorsStream(tensors, block=block)
    blocks = list(stream)
    data = b"".join(blocks)
    assert len(data) == len(stream)
    assert all(len(b) <= block for b in blocks[1:])  # the header first, then tensor bytes in blocks
    loaded = load(data)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor), name
    assert data == b"".join(stream)  # iterating again gives the same bytes
    assert data == save(
        {n: t.contiguous() for n, t in tensors.items()}
    )  # byte for byte, as safetensors writes


def test_the_fronts_check_accepts_the_stream(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"".join(SafetensorsStream(mixed())))
    check_safetensors(path)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ValueError, match="the upload has"):
        check_safetensors(path)


def small_llama(vocab: int = 11, *, tied: bool = False) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def on_two_ranks(target: Any, tmp_path: Path, *args: Any) -> None:
    """``target(rank, store, folder, *args)`` on 2 processes forked as ranks are (trainer/rank_launch.py),
    each ending with exit code 0."""
    from trainer.rank_launch import rank_start_method

    context = multiprocessing.get_context(rank_start_method())
    where = (str(tmp_path / "store"), str(tmp_path), *args)
    ranks = [context.Process(target=target, args=(r, *where)) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=180)
    assert [p.exitcode for p in ranks] == [0, 0]


def test_tied_weights_are_sent_once_under_the_name_save_model_keeps(tmp_path: Path) -> None:
    model = small_llama(32, tied=True)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    save_model(model, str(tmp_path / "saved.safetensors"))
    (tmp_path / "streamed.safetensors").write_bytes(b"".join(SafetensorsStream(state)))
    files = {}
    for kind in ("saved", "streamed"):
        with safe_open(str(tmp_path / f"{kind}.safetensors"), framework="pt") as f:
            files[kind] = (f.metadata(), {name: f.get_tensor(name) for name in f.keys()})
    (saved_meta, saved), (streamed_meta, streamed) = files["saved"], files["streamed"]
    assert len(streamed) == len(state) - 1 and streamed.keys() == saved.keys()
    assert streamed_meta == saved_meta  # {dropped name: kept name}, as save_model records it
    for name, tensor in saved.items():
        assert torch.equal(streamed[name], tensor), name
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "saved.safetensors").read_bytes()


def test_what_safetensors_cannot_hold_is_refused_naming_the_tensor() -> None:
    with pytest.raises(ValueError, match="'c' is torch.complex64"):
        SafetensorsStream({"c": torch.zeros(2, dtype=torch.complex64)})
    buffer = torch.arange(10.0)
    with pytest.raises(ValueError, match=r"\['a', 'b'\] share one storage and none covers all of it"):
        SafetensorsStream({"a": buffer[:5], "b": buffer[5:]})


def test_tied_names_are_the_names_save_model_drops(tmp_path: Path) -> None:
    from tests.rollout.sharded_stream_ranks import tied_tiny_model

    model = tied_tiny_model()
    path = tmp_path / "model.safetensors"
    save_model(model, str(path))
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    assert tied_names(model) == metadata == {"model.embed_tokens.weight": "lm_head.weight"}
    assert tied_names(small_llama()) == {}


CPU_RANKS = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU gloo ranks (NCCL: tests/loops/test_gpu.py)"
)


@CPU_RANKS
def test_a_sharded_model_streams_the_file_save_model_writes_a_parameter_at_a_time(tmp_path: Path) -> None:
    """2 gloo ranks shard a tied model (FSDP2) and stream it: as one host (rank 0 sends, rank 1 joins the
    gathers), as two hosts (both send), and with rank 0's send cut short; each case's bytes equal
    ``save_model``'s of the unsharded model, and the ranks' collectives stay in step (tests/rollout/
    sharded_stream_ranks.py)."""
    from tests.rollout.sharded_stream_ranks import stream_on_rank

    on_two_ranks(stream_on_rank, tmp_path)
    expected = (tmp_path / "expected.safetensors").read_bytes()
    for name in ("rank0-one-host", "rank0-two-hosts", "rank1-two-hosts"):
        assert (tmp_path / f"{name}.safetensors").read_bytes() == expected, name
    assert not (tmp_path / "rank1-one-host.safetensors").exists()


class FailingStream(SafetensorsStream):
    """The stream of ``tensors`` that fails after its header (a gather or a disk that gave out mid-sync)."""

    def __iter__(self) -> Iterator[bytes]:
        blocks = super().__iter__()
        yield next(blocks)
        raise OSError("no space left on device")


def test_a_sync_that_fails_while_writing_keeps_the_last_whole_weights_for_a_restart(tmp_path: Path) -> None:
    """The file a restarted engine reloads (``ServedEngine._restart``) is never one a failed sync left
    half-written: the stream goes to a hidden file that replaces it only once complete (no engine needed:
    the write fails before the engine is asked to reload)."""
    from trainer.rollout.served_engine import ServedEngine

    served = ServedEngine("http://127.0.0.1:9", max_model_len=64, weights_dir=tmp_path)
    whole = b"".join(SafetensorsStream(mixed()))
    (tmp_path / "model.safetensors").write_bytes(whole)
    try:
        with pytest.raises(OSError, match="no space left"):
            served.sync_stream(FailingStream({"w": torch.ones(3)}))
    finally:
        served.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == whole


@CPU_RANKS
def test_a_sharded_adapter_streams_the_merged_weights_and_saves_the_adapter_one_process_would(
    tmp_path: Path,
) -> None:
    """2 gloo ranks shard a LoRA model (FSDP2): the merged weights streamed a layer at a time
    (``merged_stream``) are the file one process's ``merged_state_dict`` gives, bit for bit, and the adapter
    saved from the gathered LoRA tensors is the one ``save_pretrained`` writes unsharded."""
    from tests.rollout.sharded_stream_ranks import adapter_on_rank

    on_two_ranks(adapter_on_rank, tmp_path)
    expected = (tmp_path / "expected-merged.safetensors").read_bytes()
    assert (tmp_path / "merged.safetensors").read_bytes() == expected
    merged = load(expected)
    assert "model.layers.0.self_attn.q_proj.weight" in merged and not any("lora" in n for n in merged)
    adapter = (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()
    assert adapter == (tmp_path / "expected-adapter" / "adapter_model.safetensors").read_bytes()
    assert len(load(adapter)) == 8  # A and B of q_proj and v_proj in both layers


def test_one_process_streams_the_merge_of_any_lora_layer_as_merged_state_dict_computes_it() -> None:
    """On one process ``merged_stream`` (every merged engine sync) makes each merged layer as the stream
    reaches it, with peft's own ``get_delta_weight``: a LoRA on the embedding too (sharded ranks refuse it:
    tests/rollout/sharded_stream_ranks.py), the bytes those of ``merged_state_dict``'s whole copy."""
    from peft import LoraConfig, get_peft_model

    from trainer.adapters import merged_state_dict
    from trainer.rollout.weight_streams import merged_stream

    torch.manual_seed(0)
    model = get_peft_model(small_llama(), LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.5)
    expected = b"".join(SafetensorsStream(merged_state_dict(model)))
    assert b"".join(merged_stream(model)) == expected
    base = load(b"".join(SafetensorsStream(model.get_base_model().state_dict())))
    merged = load(expected)
    assert not torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.base_layer.weight"])


def test_an_adapter_whose_biases_train_is_refused_as_a_lora_from_shards() -> None:
    """What ``gathered_adapter_state`` would leave out (trained biases) is refused, before any gather."""
    from peft import LoraConfig, get_peft_model

    from trainer.rollout.weight_streams import gathered_adapter_state

    biased = get_peft_model(small_llama(), LoraConfig(r=2, target_modules=["q_proj"], bias="lora_only"))
    with pytest.raises(NotImplementedError, match="bias 'lora_only'"):
        gathered_adapter_state(biased)
