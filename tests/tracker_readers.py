"""Reading what rlrun sent to the trackers back through the trackers' own readers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def wandb_records(folder: Path) -> list[dict[str, Any]]:
    """Every record of the offline run's transaction log, through W&B's own reader."""
    wandb_cli = str(Path(sys.executable).with_name("wandb"))
    out = subprocess.run(
        [wandb_cli, "leet", "inspect", "--json", str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
