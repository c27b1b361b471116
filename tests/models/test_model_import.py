"""rlrun models import, below the API: a GGUF file (written here by the gguf package's writer from a tiny
preset, laid out as llama.cpp lays it out) or a safetensors folder becomes a model folder that loads with the
same weights, tokenizer and chat template; bad input is refused and leaves nothing in the model root."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.models.gguf_files import CHATML, write_llama_gguf
from trainer.model_folders import IMPORT_RECORD, parameter_count, read_import_record
from trainer.model_import import ImportRefused, import_model, main
from trainer.model_refs import models_in_roots
from trainer.models import load_causal_lm, tiny_model_dir

PRESET = "llama-10m"


@pytest.fixture(scope="module")
def tiny_folder(tiny_cache: Path) -> Path:
    return tiny_model_dir(PRESET, tiny_cache)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tokenizer = load_causal_lm(str(tiny_folder))
    return write_llama_gguf(model, tokenizer, tmp_path_factory.mktemp("gguf") / "Tiny-Llama.Q8.gguf")


def _root_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_a_gguf_file_imports_to_a_folder_with_the_same_weights_tokenizer_and_template(
    tiny_folder: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    record = import_model(tiny_gguf, root, "tiny-from-gguf")
    folder = root / "tiny-from-gguf"
    model, tokenizer = load_causal_lm(str(folder))
    original, original_tokenizer = load_causal_lm(str(tiny_folder))
    imported = model.state_dict()
    for key, value in original.state_dict().items():
        assert torch.equal(imported[key], value), key  # fp32 in, fp32 out: the permutation undone exactly
    text = "What is 12 + 7? 19 apples."
    assert tokenizer(text).input_ids == original_tokenizer(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.chat_template == CHATML
    numel = sum(v.numel() for v in original.state_dict().values())
    assert record["parameters"] == numel == parameter_count(folder)
    assert record["kind"] == "gguf" and record["architecture"] == "llama"
    assert record["source"] == str(tiny_gguf.resolve())
    assert read_import_record(folder) == record
    assert models_in_roots([root]) == ["tiny-from-gguf"]
    assert _root_entries(root) == ["tiny-from-gguf"]  # the staging folder is gone


def test_a_safetensors_folder_imports_by_copy_and_counts_its_parameters(
    tiny_folder: Path, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    record = import_model(tiny_folder, root, "org/tiny")
    folder = root / "org" / "tiny"
    with safe_open(str(tiny_folder / "model.safetensors"), "pt") as f:
        numel = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert record["parameters"] == numel and record["kind"] == "folder"
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (folder / name).read_bytes() == (tiny_folder / name).read_bytes()
    model, _ = load_causal_lm(str(folder))
    assert model.config.vocab_size > 0
    assert models_in_roots([root]) == ["org/tiny"]


def test_a_file_that_is_not_gguf_is_refused_naming_the_magic_and_writes_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf file")
    root = tmp_path / "models"
    with pytest.raises(ImportRefused, match=r"not a GGUF file \(it starts with b'PK"):
        import_model(bad, root, "bad")
    assert _root_entries(root) == []


def test_a_truncated_gguf_is_refused_and_leaves_no_staging_folder(tiny_gguf: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 3])
    root = tmp_path / "models"
    root.mkdir()
    with pytest.raises(ImportRefused, match="cut.gguf: transformers could not read this GGUF file"):
        import_model(cut, root, "cut")
    assert _root_entries(root) == []


def test_a_folder_with_a_corrupt_safetensors_header_or_only_pickles_is_refused(
    tiny_folder: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_folder / name).read_bytes())
    (broken / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
    root = tmp_path / "models"
    with pytest.raises(ImportRefused, match="model.safetensors: header length"):
        import_model(broken, root, "broken")
    (broken / "model.safetensors").unlink()
    (broken / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ImportRefused, match="no \\*.safetensors weights \\(pickled"):
        import_model(broken, root, "broken")
    assert _root_entries(root) == []


def test_a_taken_name_or_a_bad_name_is_refused_and_the_existing_model_is_untouched(
    tiny_folder: Path, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    import_model(tiny_folder, root, "tiny")
    before = (root / "tiny" / IMPORT_RECORD).read_text()
    with pytest.raises(ImportRefused, match="a model named 'tiny' already exists"):
        import_model(tiny_folder, root, "tiny")
    with pytest.raises(ImportRefused, match="model name '../escape'"):
        import_model(tiny_folder, root, "../escape")
    assert (root / "tiny" / IMPORT_RECORD).read_text() == before
    assert _root_entries(root) == ["tiny"]


def test_the_module_entry_point_prints_the_record_or_the_error_as_json(
    tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "models"
    assert main(["--source", str(tiny_folder), "--root", str(root), "--name", "t", "--origin", "x"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["name"] == "t" and record["origin"] == "x"
    assert main(["--source", str(tiny_folder), "--root", str(root), "--name", "t"]) == 2
    taken = json.loads(capsys.readouterr().out)  # the API answers 409 for this one, 400 for the others
    assert taken["name_taken"] is True and "a model named 't' already exists" in taken["error"]
    assert main(["--source", str(tmp_path / "missing.gguf"), "--root", str(root), "--name", "u"]) == 2
    assert json.loads(capsys.readouterr().out) == {"error": f"{tmp_path / 'missing.gguf'} does not exist"}
