"""Model references -> loaded models and tokenizers: causal LMs, reward models (a scalar head), devices.

``tiny:<preset>`` models are random-init Llama models with a byte-level BPE tokenizer trained offline on
a built-in corpus. They are built once into the cache folder and then loaded through
``AutoModelForCausalLM``/``AutoTokenizer.from_pretrained`` like any real model folder, so the loading
path is the same for a user's local model or a hub id.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from trainer.adapters import base_of, is_adapter_folder, load_adapter, merged
from trainer.data.reward import GroupBatch
from trainer.model_refs import is_local_path, resolve_name
from trainer.specs import TINY_PRESETS, parse_run_ref

PRESET_SEED = 0  # a preset is a fixed starting point: the same weights on every machine and run
TOKENIZER_VOCAB = 512
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}
REWARD_STATS_FILE = "reward_stats.json"  # score mean/std written next to a trained reward model


def _corpus() -> list[str]:
    """Text the tiny tokenizer is trained on: digits and arithmetic, chat markers, common English."""
    words = (
        "the of and to in is you that it he was for on are as with his they at be this have from or one "
        "had by word but not what all were we when your can said there use an each which she do how their "
        "if will up other about out many then them these so some her would make like him into time has look "
        "two more write go see number no way could people my than first water been call who oil its now find "
        "long down day did get come made may part answer question because think step reward good bad yes "
        "Human Assistant user assistant system"
    ).split()
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 6)]
    lines += [f"{a}+{b}={a + b}" for a in range(0, 100, 3) for b in range(0, 100, 7)]
    lines += [f"{a}*{b}={a * b} {a}-{b}={a - b}" for a in range(0, 30) for b in range(0, 30, 4)]
    lines += ["\n\nHuman: what is 2+2?\n\nAssistant: 4", "<think>step</think><answer>42</answer>"]
    return lines


def build_tiny_tokenizer(char_level: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE (any text encodes) with pad distinct from EOS and left padding for generation.

    ``char_level``: the vocabulary is just the 256 byte symbols and the specials (no merges), so every
    character is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + len(SPECIAL_TOKENS) if char_level else TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast: PreTrainedTokenizerFast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, padding_side="left", **SPECIAL_TOKENS
    )
    return fast


def build_tiny_model(preset: str, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(PRESET_SEED)
    return LlamaForCausalLM(tiny_config(preset, tokenizer))


def tiny_config(preset: str, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """The Llama config of a preset (its dimensions, the tokenizer's vocabulary and special tokens)."""
    dims = TINY_PRESETS[preset]
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=dims["hidden_size"],
        intermediate_size=dims["intermediate_size"],
        num_hidden_layers=dims["num_hidden_layers"],
        num_attention_heads=dims["num_attention_heads"],
        num_key_value_heads=dims["num_attention_heads"],
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )


def tiny_model_dir(preset: str, cache_dir: Path) -> Path:
    """The preset's folder, built on first use (atomically, so concurrent workers never see half a model)."""
    target = cache_dir / "tiny" / preset
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=target.parent))
    try:
        tokenizer = build_tiny_tokenizer(char_level=bool(TINY_PRESETS[preset].get("char_level")))
        build_tiny_model(preset, tokenizer).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


RunOutputLookup = Callable[[str], Path]  # "run:<id>[@<step>]" -> the folder of that model


def resolve_model(
    ref: str,
    *,
    cache_dir: Path,
    run_output: RunOutputLookup,
    roots: Sequence[Path] | None = None,
    allow_hub: bool = False,
) -> str:
    """A folder (or, with ``allow_hub``, a hub id) that ``from_pretrained`` can load, for any accepted
    model reference. Plain names resolve inside the model roots (trainer/model_refs.py), never relative
    to the working directory: ``from_pretrained("org/name")`` would load a folder of that name there."""
    if ref.startswith("tiny:"):
        return str(tiny_model_dir(ref.removeprefix("tiny:"), cache_dir))
    if parse_run_ref(ref) is not None:
        return str(run_output(ref))
    # Checked again at load time: the spec may predate a change of roots.
    target = resolve_name(ref, roots or [], allow_hub=allow_hub, presets=TINY_PRESETS)
    if target != ref or is_local_path(ref):
        return target
    from huggingface_hub import snapshot_download  # the hub, where allowed: into the HF cache, by id

    # Only what the safetensors-only loader reads: no .bin, .pth or gguf copies of the weights.
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "tokenizer*"]
    return str(snapshot_download(repo_id=ref, allow_patterns=patterns))


def load_causal_lm(
    path: str, quantization: Any = None, dtype: torch.dtype = torch.float32
) -> tuple[Any, Any]:
    """Model and tokenizer from a folder or hub id; a missing pad token falls back to EOS. An adapter
    folder (an adapter run's checkpoint) loads its base with the adapter merged in (trainer/adapters.py).

    Safetensors only (a pickle checkpoint can run code when loaded) and no remote code. ``quantization``:
    a BitsAndBytesConfig for a QLoRA base (CUDA only). ``dtype``: the weights' dtype whatever the
    checkpoint's (transformers would keep a bf16 checkpoint in bf16): float32 for weights that train (the
    master copy, trainer/precision.py), a half dtype for frozen ones under mixed precision."""
    if is_adapter_folder(path):
        base, _ = load_causal_lm(base_of(path), dtype=dtype)
        return merged(load_adapter(base, path, trainable=False)), _tokenizer(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        extra = quantized_load(quantization)
        model = AutoModelForCausalLM.from_pretrained(
            path, use_safetensors=True, trust_remote_code=False, dtype=dtype, **extra
        )
    except (OSError, ValueError) as exc:  # missing files; a folder that holds no usable tokenizer
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"could not load model {path!r}: {first_line}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def quantized_load(quantization: Any) -> dict[str, Any]:
    """``from_pretrained`` arguments for a QLoRA base: the bitsandbytes config, on the current CUDA device."""
    if quantization is None:
        return {}
    return {"quantization_config": quantization, "device_map": {"": torch.cuda.current_device()}}


def _tokenizer(path: str) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def pick_device() -> torch.device:
    """The first CUDA device when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide the load report that lists ``score.weight`` as newly initialised: that is the point here."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load_reward_model(
    path: str, quantization: Any = None, dtype: torch.dtype = torch.float32
) -> tuple[Any, Any]:
    """A one-label sequence classifier and its tokenizer from a causal-LM or reward-model folder.

    From a causal LM the LM head is dropped and a fresh ``score`` head is initialised from torch's RNG
    (seed before calling for a reproducible head). ``config.pad_token_id`` is set to the tokenizer's pad
    token (EOS when there is none), which is what the model uses to find the last real token. An adapter
    folder (an adapter reward-model run) loads its base with the adapter and trained head merged in.
    ``dtype`` as for ``load_causal_lm``.
    """
    if is_adapter_folder(path):
        base, tokenizer = load_reward_model(base_of(path), dtype=dtype)
        model = merged(load_adapter(base, path, trainable=False))
        model.config.pad_token_id = tokenizer.pad_token_id
        return model, tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        extra = quantized_load(quantization)
        with _quiet_transformers():
            model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, use_safetensors=True, trust_remote_code=False, dtype=dtype, **extra
            )
    except OSError as exc:
        raise ValueError(f"could not load model {path!r}: {str(exc).splitlines()[0]}") from exc
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer of {path!r} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"  # saved with the checkpoint, so a scorer pads the same way
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def read_reward_stats(folder: Path | str) -> dict[str, Any] | None:
    """``{"mean", "std", "n", "source"}`` written next to a trained reward model, or None if absent."""
    file = Path(folder) / REWARD_STATS_FILE
    if not file.exists():
        return None
    stats: dict[str, Any] = json.loads(file.read_text())
    return stats


def sequence_scores(model: Any, batch: GroupBatch, device: torch.device) -> Tensor:
    """(N,) scalar score of every sequence of the batch, in one forward pass."""
    out = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device))
    scores: Tensor = out.logits.squeeze(-1).float()
    return scores
