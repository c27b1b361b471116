"""Specs <-> registries name sync, and the layering: the API never imports torch nor the worker and the
training loops; the client (``rlrun.client``, the CLI's client commands) never imports the server."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import get_args

import pytest

from trainer import specs


def test_spec_literal_names_equal_registry_keys() -> None:
    from trainer.algorithms.advantages import ADVANTAGES
    from trainer.algorithms.aggregation import AGGREGATIONS
    from trainer.algorithms.kl import KL_ESTIMATORS
    from trainer.algorithms.kl_control import KL_CONTROLLERS
    from trainer.algorithms.policy_losses import POLICY_LOSSES
    from trainer.algorithms.preference_losses import PREFERENCE_LOSSES

    assert set(get_args(specs.PreferenceLossName)) == set(PREFERENCE_LOSSES)
    assert set(get_args(specs.AdvantageName)) == set(ADVANTAGES)
    assert set(get_args(specs.PolicyLossName)) == set(POLICY_LOSSES)
    assert set(get_args(specs.KlEstimatorName)) == set(KL_ESTIMATORS)
    assert set(get_args(specs.AggregationName)) == set(AGGREGATIONS)
    assert set(get_args(specs.KlControllerName)) == set(KL_CONTROLLERS)


def test_loops_cover_every_algorithm() -> None:
    from trainer.loops import LOOPS

    assert set(LOOPS) == set(specs.ALGORITHMS)


def test_unknown_loss_name_is_refused_listing_valid_names() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as err:
        specs.parse_spec(
            {
                "algorithm": "dpo",
                "model": "tiny:llama-0.4m",
                "dataset_id": "1b4e28ba-2fa1-11d2-883f-0016d3cca427",
                "hyperparameters": {"loss_type": "nope"},
            }
        )
    text = str(err.value)
    assert all(name in text for name in get_args(specs.PreferenceLossName))


def test_importing_the_api_does_not_import_torch() -> None:
    code = (
        "import sys, api.main, rlrun.cli; rlrun.cli.build_parser(); "
        "assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("api", "trainer", "rlrun")


def _module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path, module: str) -> set[str]:
    """Every module an import statement of the file names, lazy ones inside functions included; for
    ``from x import y`` both ``x`` and ``x.y`` (``y`` may be a submodule), and the packages above each."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this file's package
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    parts = {".".join(name.split(".")[:i]) for name in names for i in range(1, name.count(".") + 1)}
    return names | parts


def _reachable_from(start: list[str]) -> dict[str, list[str]]:
    """First-party modules the ``start`` modules import, directly or through each other (whether at import
    time or inside a function), each with the chain of imports that reaches it."""
    chains = {name: [name] for name in start}
    queue = deque(start)
    while queue:
        name = queue.popleft()
        path = _module_file(name)
        if path is None:
            continue
        for imported in sorted(_imports(path, name)):
            if imported.split(".")[0] in FIRST_PARTY and imported not in chains and _module_file(imported):
                chains[imported] = [*chains[name], imported]
                queue.append(imported)
    return chains


def test_the_api_never_imports_the_worker_nor_the_training_loops() -> None:
    """The API sends runs by task name (``api.queue``); the server commands that start a worker live in
    ``rlrun.server_commands``. No import under ``api/``, even a lazy one, reaches either."""
    api_modules = [
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in sorted((ROOT / "api").rglob("*.py"))
    ]
    assert "api.main" in api_modules and "api.queue" in api_modules
    chains = _reachable_from(api_modules)
    assert "trainer.specs" in chains  # the scan follows imports into trainer
    banned = ("trainer.worker", "trainer.loops")
    found = {
        name: " -> ".join(chain)
        for name, chain in chains.items()
        if any(name == b or name.startswith(b + ".") for b in banned)
    }
    assert not found, found


CLIENT_SIDE = """
import json, os, socket, sys, tempfile
from rlrun.cli import build_parser, main

build_parser()
for argv in (["--help"], ["runs", "list", "--help"], ["datasets", "upload", "--help"], ["serve", "--help"]):
    try:
        main(argv)
    except SystemExit:
        pass
with socket.socket() as s:  # a port nothing listens on: the commands run up to the connection
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}"
path = os.path.join(tempfile.mkdtemp(), "pairs.jsonl")
with open(path, "w") as fh:
    fh.write(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}) + "\\n")
codes = [
    main(["datasets", "upload", path, "--kind", "sft", "--url", url]),  # refused here: the file is preference
    main(["datasets", "upload", path, "--kind", "preference", "--url", url]),
    main(["runs", "list", "--url", url]),
    main(["runs", "get", "0545f43f-bae8-4d0e-b450-9f31e33a081e", "--url", url]),
]
import rlrun.client, rlrun.commands, rlrun.schemas, rlrun.formats
from rlrun import Client
Client(url).close()
server = {"fastapi", "starlette", "torch", "trainer", "sqlalchemy", "api", "celery", "uvicorn"}
print(json.dumps({"codes": codes, "server": sorted(m for m in sys.modules if m.split(".")[0] in server)}))
"""


def test_the_client_and_its_commands_never_import_the_server() -> None:
    """``rlrun.client`` and the CLI's client commands (parser, --help, real commands up to the network)
    import no FastAPI, torch, trainer, SQLAlchemy or api: a user's machine needs only pydantic and httpx."""
    out = subprocess.run(
        [sys.executable, "-c", CLIENT_SIDE], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["server"] == []
    assert result["codes"] == [1, 1, 1, 1]  # each ran and failed as a client does (exit 1, no traceback)
    assert "is not sft data" in out.stderr and "cannot reach the rlrun server" in out.stderr
