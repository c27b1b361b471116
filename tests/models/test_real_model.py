"""SmolLM2-135M-Instruct from its packaged GGUF (issue 38 items 1, 2): the import keeps every parameter the
file holds and the model's own chat template, and the imported model answers in sentences."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from trainer.model_folders import parameter_count, read_import_record

pytestmark = [pytest.mark.slow]


def test_the_import_holds_every_parameter_of_the_gguf_and_records_its_origin(
    real_gguf: Path, real_model_folder: Path
) -> None:
    import gguf

    reader = gguf.GGUFReader(str(real_gguf))
    in_file = sum(math.prod(int(d) for d in t.shape) for t in reader.tensors)
    # The file ties the output layer to the embedding (no output.weight), and so does the folder's config.
    assert parameter_count(real_model_folder) == in_file == 134_515_008  # SmolLM2-135M's published size
    config = json.loads((real_model_folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    record = read_import_record(real_model_folder)
    assert record is not None and record["origin"] == "catalog:smollm2-135m-instruct"
    assert record["architecture"] == "llama" and record["chat_template"] is True


def test_its_chat_template_renders_chatml_with_the_default_system_turn(real_model_folder: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_folder)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token == "<|im_end|>"
