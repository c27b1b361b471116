"""What an adapter folder on disk is (torch-free: the API reads it too, trainer/adapters.py loads it).

An adapter checkpoint holds peft's ``adapter_config.json`` and our ``rlrun_base.json`` naming the folder of
the model it was trained on; that base may itself be an adapter folder (an adapter run started from
another adapter run), down to a full model at the root.
"""

from __future__ import annotations

import json
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
BASE_FILE = "rlrun_base.json"  # {"base": <folder of the model the adapter was trained on>}


def is_adapter_folder(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def base_of(folder: str | Path) -> str:
    """The folder of the model an adapter folder was trained on (ours, else peft's own record)."""
    ours = Path(folder) / BASE_FILE
    if ours.exists():
        return str(json.loads(ours.read_text())["base"])
    return str(json.loads((Path(folder) / ADAPTER_CONFIG).read_text())["base_model_name_or_path"])


def root_base(folder: str) -> str:
    """The full model under a chain of adapters (``folder`` itself when it is no adapter)."""
    while is_adapter_folder(folder):
        folder = base_of(folder)
    return folder
