"""A GGUF file or a model folder -> a model folder under a model root that every rlrun path loads: the
Hugging Face layout (``config.json``, ``*.safetensors``, the tokenizer with its chat template,
``generation_config.json``) and ``rlrun-import.json``, the record of where it came from.

- **GGUF** (llama.cpp's single-file format): transformers reads it (``from_pretrained(folder,
  gguf_file=name)``, with the ``gguf`` package), dequantising every tensor to fp32; the GGUF quantizer it
  attaches is dropped before saving, since the weights are plain tensors by then and ``save_pretrained``
  refuses a quantized model. Architectures are those transformers' GGUF loader knows (llama, qwen2,
  mistral, ...); any other gets its error.
- **A folder** with ``config.json`` and ``*.safetensors``: its config and tokenizer are loaded (refused if
  transformers cannot), each safetensors header is read, and the files are copied. Pickled weights
  (``pytorch_model*.bin``) are refused, as everywhere in rlrun: loading a pickle can run code.

A chat model's tokenizer gets the template's end-of-turn token as its EOS where they differ (Gemma's
``<end_of_turn>`` beside ``<eos>``; trainer/data/chat_turns.py), the old EOS kept as a second stop token in
``generation_config.json``: SFT targets, rollouts and chat then end a turn as the template does.

The folder is built in a hidden sibling (``<root>/.import-<uuid>``, which listings skip) and renamed into
place when complete: a corrupt file, a refused folder or a killed import leaves nothing under the name.
Run as ``python -m trainer.model_import`` by the API (``POST /v1/models/import``), so the API process never
imports torch; it prints the record as one JSON line, or ``{"error": ...}`` (with ``"name_taken": true``
for a name in use) and exit status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from trainer.data.chat_turns import end_of_turn_token
from trainer.model_folders import IMPORT_RECORD, parameter_count, safetensors_parameters
from trainer.model_refs import UnknownModel, check_hub_id

GGUF_MAGIC = b"GGUF"
# What a folder import copies besides the weights: config, generation config, tokenizer files, templates.
_FOLDER_FILES = ("*.json", "*.jinja", "*.txt", "*.model", "tokenizer*")


class ImportRefused(ValueError):
    """Input that cannot become a model folder (the message says which and why); nothing was written."""


class NameTaken(ImportRefused):
    """The model root already holds a model under the asked name."""


def check_model_name(name: str) -> str:
    """``name`` or ``org/name`` as a spec names a folder under a root (trainer/model_refs.py's rule)."""
    try:
        return check_hub_id(name)
    except UnknownModel:
        raise ImportRefused(f"model name {name!r}: use letters, digits, _ . - and at most one /") from None


def source_kind(path: Path) -> Literal["gguf", "folder"]:
    """``gguf`` for a file that starts with GGUF's magic, ``folder`` for a directory with ``config.json``."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ImportRefused(f"{path} is a folder without config.json: not a Hugging Face model folder")
        return "folder"
    if not path.is_file():
        raise ImportRefused(f"{path} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ImportRefused(
            f"{path.name} is not a GGUF file (it starts with {magic!r}, GGUF files with {GGUF_MAGIC!r}); "
            "import a .gguf file or a folder with config.json and *.safetensors"
        )
    return "gguf"


def default_name(path: Path) -> str:
    """A model name from a file or folder name: lower case, ``[a-z0-9_.-]`` only."""
    stem = path.stem if path.is_file() else path.name
    cleaned = "".join(c if c.isalnum() or c in "_.-" else "-" for c in stem.lower()).strip(".-")
    return cleaned or "model"


def import_model(source: Path, root: Path, name: str, *, origin: str | None = None) -> dict[str, Any]:
    """Import ``source`` as ``<root>/<name>``; the record written beside the weights is returned.
    ImportRefused for bad input or a name already taken (nothing is written then)."""
    check_model_name(name)
    source = source.expanduser().resolve()
    kind = source_kind(source)
    dest = root / name
    if dest.exists():
        raise NameTaken(f"a model named {name!r} already exists in {root}; choose another name")
    started = time.monotonic()
    with _staging(root) as staging:
        if kind == "gguf":
            details = _convert_gguf(source, staging)
        else:
            details = _copy_folder(source, staging)
        record = {
            "name": name,
            "source": str(source),
            "kind": kind,
            "origin": origin,
            "parameters": parameter_count(staging),
            "imported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.monotonic() - started, 1),
            **details,
        }
        (staging / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            staging.rename(dest)  # atomic on one filesystem; fails if a concurrent import took the name
        except OSError:
            raise NameTaken(f"a model named {name!r} already exists in {root}; choose another name") from None
    return record


@contextmanager
def _staging(root: Path) -> Iterator[Path]:
    """A hidden folder under the root, removed unless it was renamed into place."""
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".import-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        yield staging
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**22), b""):
            digest.update(block)
    return digest.hexdigest()


def _convert_gguf(file: Path, dest: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.models import _quiet_transformers

    try:
        with _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                file.parent, gguf_file=file.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except ImportError as exc:  # the gguf package missing
        raise ImportRefused(
            f"reading GGUF needs the gguf package (pip install gguf==0.19.0): {exc}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - transformers/gguf raise many kinds on a corrupt or unknown file
        raise ImportRefused(f"{file.name}: transformers could not read this GGUF file: {exc}") from None
    # The weights are plain fp32 tensors now; the quantizer only remembers the file's format.
    setattr(model, "hf_quantizer", None)  # noqa: B010 - typed as a module attribute by torch's stubs
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    stops = _end_turns_with_template(tokenizer)
    if stops is not None:
        model.generation_config.eos_token_id = stops
        model.config.eos_token_id = stops[0]
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return {
        "sha256": _sha256(file),
        "architecture": model.config.model_type,
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "eos_token": tokenizer.eos_token,
    }


def _end_turns_with_template(tokenizer: Any) -> list[int] | None:
    """Make the template's end-of-turn token the tokenizer's EOS where it is another token; the stop ids
    for ``generation_config`` (end of turn first, the old EOS after), or None where nothing changed."""
    end = end_of_turn_token(tokenizer)
    if end is None or end == tokenizer.eos_token:
        return None
    old = tokenizer.eos_token_id
    tokenizer.eos_token = end
    return [tokenizer.eos_token_id] + ([old] if old is not None and old != tokenizer.eos_token_id else [])


def _copy_folder(folder: Path, dest: Path) -> dict[str, Any]:
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - a config or tokenizer transformers cannot read, of any kind
        raise ImportRefused(f"{folder}: transformers could not read its config or tokenizer: {exc}") from None
    weights = sorted(folder.glob("*.safetensors"))
    for file in weights:
        try:
            safetensors_parameters(file)
        except ValueError as exc:
            raise ImportRefused(f"{folder}: {exc}") from None
    if not weights:
        pickled = (
            " (pickled *.bin weights are refused: loading a pickle can run code)"
            if any(folder.glob("*.bin"))
            else ""
        )
        raise ImportRefused(f"{folder} holds no *.safetensors weights{pickled}")
    copied = {p for pattern in _FOLDER_FILES for p in folder.glob(pattern) if p.is_file()}
    for file in sorted(copied | set(weights)):
        if file.name != IMPORT_RECORD:
            shutil.copy2(file, dest / file.name)
    stops = _end_turns_with_template(tokenizer)
    if stops is not None:
        tokenizer.save_pretrained(dest)
        for name, key_value in (("generation_config.json", stops), ("config.json", stops[0])):
            path = dest / name
            saved = json.loads(path.read_text()) if path.is_file() else {}
            path.write_text(json.dumps({**saved, "eos_token_id": key_value}, indent=2) + "\n")
    return {
        "architecture": config.model_type,
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "eos_token": tokenizer.eos_token,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.model_import", description=__doc__)
    parser.add_argument("--source", required=True, type=Path)
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--origin", default=None)
    args = parser.parse_args(argv)
    try:
        record = import_model(args.source, args.root, args.name, origin=args.origin)
    except ImportRefused as exc:
        taken = {"name_taken": True} if isinstance(exc, NameTaken) else {}
        sys.stdout.write(json.dumps({"error": str(exc), **taken}) + "\n")
        return 2
    sys.stdout.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
