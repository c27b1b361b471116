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


def test_chat_rows_train_toward_the_end_of_turn_and_rollouts_stop_there_with_the_answer_readable(
    real_model_folder: Path,
) -> None:
    from trainer.data.chat_turns import end_of_turn_token
    from trainer.data.prompts import render_prompt
    from trainer.data.sft import tokenize_example
    from trainer.models import load_causal_lm
    from trainer.rewards.verifiers import Sample, numeric
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.hf_engine import HFEngine

    model, tokenizer = load_causal_lm(str(real_model_folder))
    assert end_of_turn_token(tokenizer) == "<|im_end|>" == tokenizer.eos_token
    row = {"prompt": [{"role": "user", "content": "What is 3 + 4?"}], "completion": "3 + 4 = 7."}
    example = tokenize_example(row, tokenizer, max_length=128)
    assert tokenizer.decode(example.prompt).endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(example.completion) == "3 + 4 = 7.<|im_end|>"

    prompts = [[{"role": "user", "content": "Say hello in one short sentence."}]]
    ids = [tokenizer(render_prompt(p, tokenizer)).input_ids for p in prompts]
    [done] = HFEngine(model, tokenizer).generate(ids, 1, SamplingParams(max_new_tokens=48, greedy=True))
    assert done.finish_reason == "eos" and done.token_ids[-1] == tokenizer.eos_token_id
    assert done.text.strip() and "<|im" not in done.text and done.text[0].isalpha(), done.text
    # A verifier reads the decoded answer, not the template: "... 7." scores against the reference 7.
    sample = Sample(
        prompt="",
        completion=tokenizer.decode(example.completion, skip_special_tokens=True),
        row={"answer": "7"},
        n_tokens=len(example.completion),
        max_new_tokens=48,
        truncated=False,
    )
    assert numeric(sample) == 1.0
