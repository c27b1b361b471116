"""LoRA adapters served over one shared base (trainer/inference/loaded.py): each adapter's answers equal
those of its own merged copy (loaded the independent way, trainer/models.py's load_causal_lm), switching
back and forth keeps them apart, and two adapters of one base hold one base."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.adapters import BASE_FILE, base_file
from trainer.inference.decode import DecodeParams, decode
from trainer.inference.loaded import Loaded, LoadedModels, LoadError
from trainer.models import load_causal_lm, tiny_model_dir


def make_adapter(base: Path, folder: Path, seed: int) -> str:
    from peft import LoraConfig, get_peft_model

    model, tokenizer = load_causal_lm(str(base))
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # B starts at 0 (a no-op adapter); make each adapter really change the model
                param.normal_(0, 0.5)
    peft_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for name, text in base_file(str(base)).items():
        (folder / name).write_text(text)
    assert (folder / BASE_FILE).exists()
    return str(folder)


def greedy_logprobs(loaded: Loaded, prompt: str) -> tuple[list[int], list[float]]:
    loaded.activate()
    ids = loaded.tokenizer(prompt).input_ids
    tokens: list[int] = []
    logprobs: list[float] = []
    for step in decode(loaded.model, loaded.tokenizer, ids, 1, DecodeParams(max_new_tokens=6, temperature=0)):
        for d in step:
            tokens += d.token_ids
            logprobs += d.logprobs
    return tokens, logprobs


def test_adapters_share_their_base_and_answer_as_their_merged_copies(
    tmp_path: Path, tiny_cache: Path
) -> None:
    base = tiny_model_dir("llama-0.4m", tiny_cache)
    first = make_adapter(base, tmp_path / "a", seed=1)
    second = make_adapter(base, tmp_path / "b", seed=2)
    models = LoadedModels(size=2)
    a, b = models.get(first), models.get(second)
    assert a.model is b.model and a.adapter != b.adapter
    assert len(models.entries) == 1  # one base, two adapters

    def merged(folder: str) -> Loaded:
        model, tokenizer = load_causal_lm(folder)  # base + adapter merged into plain weights
        return Loaded(model, tokenizer)

    expected: dict[str, Any] = {f: greedy_logprobs(merged(f), "12+30=") for f in (first, second)}
    assert expected[first][1] != pytest.approx(expected[second][1], abs=1e-3), "the adapters do not differ"
    for folder in (first, second, first):  # switching back and forth
        tokens, logprobs = greedy_logprobs(models.get(folder), "12+30=")
        assert tokens == expected[folder][0]
        assert logprobs == pytest.approx(expected[folder][1], abs=1e-4)

    plain = models.get(str(base))  # the base itself is its own entry, without adapters
    assert plain.adapter is None and len(models.entries) == 2
    with pytest.raises(LoadError):
        models.get(str(tmp_path / "missing"))
