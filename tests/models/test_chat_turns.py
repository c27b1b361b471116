"""The chat template's end of turn (issue 38 item 2): read from the template, made the imported tokenizer's
EOS where it differs (Gemma's <end_of_turn> beside <eos>), so an SFT target ends its turn as the template
does; templates without a special closing token change nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainer.data.chat_turns import end_of_turn_token
from trainer.data.sft import tokenize_example
from trainer.model_import import import_model
from trainer.models import build_tiny_tokenizer, tiny_model_dir

GEMMA = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
LLAMA3 = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def tokenizer_with(template: str | None, specials: list[str]) -> Any:
    tokenizer = build_tiny_tokenizer()
    if specials:
        tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize(
    ("template", "specials", "expected"),
    [
        (GEMMA, ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
        (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
        (PLAIN, [], None),  # the answer is followed by a newline, no token
        (GEMMA, [], None),  # <end_of_turn> is plain text in this vocabulary
        (None, [], None),
    ],
)
def test_the_end_of_turn_token_is_the_special_token_after_an_assistant_message(
    template: str | None, specials: list[str], expected: str | None
) -> None:
    assert end_of_turn_token(tokenizer_with(template, specials)) == expected


def test_an_imported_gemma_style_model_ends_its_turns_and_its_sft_targets_with_end_of_turn(
    tiny_cache: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tmp_path / "gemma-style"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama-0.4m", tiny_cache))
    tokenizer = tokenizer_with(GEMMA, ["<start_of_turn>", "<end_of_turn>"])
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    old_eos = tokenizer.eos_token_id

    record = import_model(source, tmp_path / "models", "gemma-style")
    folder = tmp_path / "models" / "gemma-style"
    imported = AutoTokenizer.from_pretrained(folder)
    end = imported.convert_tokens_to_ids("<end_of_turn>")
    assert record["eos_token"] == imported.eos_token == "<end_of_turn>"
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [end, old_eos]
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == end
    row = {"prompt": [{"role": "user", "content": "2+2?"}], "completion": "4"}
    example = tokenize_example(row, imported, max_length=64)
    assert imported.decode(example.prompt).endswith("<start_of_turn>model\n")
    assert example.completion[-1] == end and old_eos not in example.completion
    assert imported.decode(example.completion) == "4<end_of_turn>"


def test_a_chatml_tokenizer_whose_eos_already_ends_the_turn_is_left_as_it_was(
    tiny_cache: Path, tmp_path: Path
) -> None:
    source = tmp_path / "chatml"
    tokenizer = tokenizer_with(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
        ["<|im_start|>"],
    )
    tokenizer.eos_token = "<|im_end|>"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama-0.4m", tiny_cache))
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    import_model(source, tmp_path / "models", "chatml")
    for name in ("tokenizer_config.json", "config.json"):
        assert (tmp_path / "models" / "chatml" / name).read_bytes() == (source / name).read_bytes()
