"""The models the inference process keeps loaded: an LRU by folder, where LoRA adapters share their base.

A plain model folder loads as itself. An adapter folder (an adapter run's output or checkpoint,
trainer/adapters.py) whose base is a plain folder is loaded onto one shared copy of that base as a named
peft adapter: ten LoRA runs of one 7B model hold one 7B base and ten small adapters, not ten merged 7B
copies. The base's tokenizer serves its adapters (an adapter does not change the vocabulary). A request
switches the base to its adapter (``Loaded.activate``) under the process's compute lock, right before it
decodes. A chain of adapters (an adapter run on an adapter run's output) loads merged, as every other
loader does. The LRU counts bases and plain models; each base keeps at most ``MAX_ADAPTERS_PER_BASE``
adapters (the least recently used is deleted first).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.inference.decode import DecodeParams, Delta, decode

MAX_ADAPTERS_PER_BASE = 32


class LoadError(Exception):
    """A folder that cannot be served: ``generative`` False for a reward model (a score head)."""

    def __init__(self, message: str, *, generative: bool = True) -> None:
        super().__init__(message)
        self.generative = generative


@dataclass
class Entry:
    """A loaded model; for a shared base, its adapters by folder (folder -> adapter name), newest last."""

    model: Any
    tokenizer: Any
    adapters: OrderedDict[str, str] = field(default_factory=OrderedDict)
    next_name: int = 0


@dataclass(frozen=True)
class Loaded:
    model: Any
    tokenizer: Any
    adapter: str | None = None  # the adapter to switch on before decoding (None: a plain model)

    @property
    def max_context(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def activate(self) -> None:
        """Put this request's adapter in place (call under the compute lock, right before decoding)."""
        if self.adapter is not None:
            self.model.set_adapter(self.adapter)

    def stream(self, prompt_ids: list[int], n: int, params: DecodeParams) -> Iterator[list[Delta]]:
        """``n`` continuations of one prompt, step by step (the caller holds the compute lock)."""
        self.activate()  # no other request switches adapters while the caller holds the lock
        yield from decode(self.model, self.tokenizer, prompt_ids, n, params)


def is_scorer(folder: str) -> bool:
    """A sequence-classification model folder, or an adapter trained for one (peft task SEQ_CLS)."""
    path = Path(folder)
    for name, key in (("config.json", "architectures"), ("adapter_config.json", "task_type")):
        try:
            value = json.loads((path / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        values = value if isinstance(value, list) else [value]
        if any(str(v).endswith("ForSequenceClassification") or v == "SEQ_CLS" for v in values):
            return True
    return False


class LoadedModels:
    """An LRU of loaded models by folder (bases shared by their adapters); ``size`` entries at most.

    The HF backend of the inference process: ``serial`` because a loaded model decodes one request at a
    time (a request's ``n`` choices in one batch), so the server holds its compute lock around loading
    and decoding."""

    name = "hf"
    serial = True

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict[str, Entry] = OrderedDict()

    def describe(self) -> list[dict[str, Any]]:
        """What is loaded now (the process's /healthz)."""
        return [{"folder": k, "adapters": list(e.adapters)} for k, e in self.entries.items()]

    def get(self, folder: str) -> Loaded:
        from trainer.adapters import base_of, is_adapter_folder

        if is_scorer(folder):
            raise LoadError(
                "this model is a reward model (a score head): it scores, it cannot generate", generative=False
            )
        if is_adapter_folder(folder):
            base = base_of(folder)
            if not is_adapter_folder(base):
                return self._adapter(folder, base)
        entry = self._entry(folder, adapter_base=False)
        return Loaded(entry.model, entry.tokenizer)

    def _entry(self, folder: str, *, adapter_base: bool) -> Entry:
        key = ("base:" if adapter_base else "") + folder
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        from trainer.models import load_causal_lm, pick_device

        try:
            model, tokenizer = load_causal_lm(folder)
        except (ValueError, OSError) as exc:
            raise LoadError(str(exc)) from None
        model.to(pick_device())
        while len(self.entries) >= self.size:
            self.entries.popitem(last=False)
        self.entries[key] = Entry(model, tokenizer)
        return self.entries[key]

    def _adapter(self, folder: str, base: str) -> Loaded:
        from peft import PeftModel

        entry = self._entry(base, adapter_base=True)
        if folder in entry.adapters:
            entry.adapters.move_to_end(folder)
            return Loaded(entry.model, entry.tokenizer, entry.adapters[folder])
        name = f"adapter{entry.next_name}"
        entry.next_name += 1
        try:
            if isinstance(entry.model, PeftModel):
                entry.model.load_adapter(folder, adapter_name=name)
            else:
                entry.model = PeftModel.from_pretrained(entry.model, folder, adapter_name=name)
        except (ValueError, OSError) as exc:
            raise LoadError(f"could not load adapter {folder!r}: {exc}") from None
        entry.model.eval()
        if len(entry.adapters) >= MAX_ADAPTERS_PER_BASE:
            _, oldest = entry.adapters.popitem(last=False)
            entry.model.delete_adapter(oldest)
        entry.adapters[folder] = name
        return Loaded(entry.model, entry.tokenizer, name)
