"""Cross-cutting rules: registries are read-only and refuse unknown names, every public callable is
documented, and the package imports only torch, the standard library and itself."""

import ast
import importlib
import inspect
import pkgutil
import sys
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import pytest

import trainer.algorithms as algorithms_pkg
from trainer.algorithms.advantages import ADVANTAGES, get_advantage
from trainer.algorithms.aggregation import AGGREGATIONS, get_aggregation
from trainer.algorithms.kl import KL_ESTIMATORS, get_kl_estimator
from trainer.algorithms.kl_control import KL_CONTROLLERS, get_kl_controller
from trainer.algorithms.policy_losses import POLICY_LOSSES, get_policy_loss
from trainer.algorithms.preference_losses import PREFERENCE_LOSSES, get_preference_loss

REGISTRIES: list[tuple[Mapping[str, Any], Callable[[str], Any], set[str]]] = [
    (
        ADVANTAGES,
        get_advantage,
        {"grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp", "reinforce_baseline", "remax"},
    ),
    (POLICY_LOSSES, get_policy_loss, {"ppo_clip", "vanilla", "gspo", "cispo"}),
    (KL_ESTIMATORS, get_kl_estimator, {"k1", "k2", "k3", "abs"}),
    (
        AGGREGATIONS,
        get_aggregation,
        {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"},
    ),
    (KL_CONTROLLERS, get_kl_controller, {"fixed", "adaptive"}),
    (PREFERENCE_LOSSES, get_preference_loss, {"sigmoid", "cdpo", "robust", "ipo", "hinge", "simpo"}),
]
IDS = ["advantages", "policy_losses", "kl", "aggregation", "kl_control", "preference_losses"]

MODULES = [
    importlib.import_module(f"trainer.algorithms.{m.name}")
    for m in pkgutil.iter_modules(algorithms_pkg.__path__)
    if not m.name.startswith("_")
]


def unwrap(fn: Any) -> Any:
    while isinstance(fn, partial):
        fn = fn.func
    return fn


@pytest.mark.parametrize(("registry", "getter", "keys"), REGISTRIES, ids=IDS)
def test_keys_lookup_and_unknown_names(
    registry: Mapping[str, Any], getter: Callable[[str], Any], keys: set[str]
) -> None:
    assert set(registry) == keys
    for name in keys:
        assert getter(name) is registry[name]
    with pytest.raises(ValueError) as err:
        getter("no-such-name")
    message = str(err.value)
    assert "no-such-name" in message
    assert all(name in message for name in keys)


@pytest.mark.parametrize(("registry", "getter", "keys"), REGISTRIES, ids=IDS)
def test_registries_are_read_only(
    registry: Mapping[str, Any], getter: Callable[[str], Any], keys: set[str]
) -> None:
    del getter, keys
    with pytest.raises(TypeError):
        registry["x"] = None  # type: ignore[index]


@pytest.mark.parametrize(("registry", "getter", "keys"), REGISTRIES, ids=IDS)
def test_registry_members_documented(
    registry: Mapping[str, Any], getter: Callable[[str], Any], keys: set[str]
) -> None:
    del getter, keys
    for name, fn in registry.items():
        doc = inspect.getdoc(unwrap(fn)) or ""
        assert "Args:" in doc and "Returns:" in doc, name


def public_callables() -> list[tuple[str, Any]]:
    out = []
    for module in MODULES:
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                out.append((f"{module.__name__}.{name}", obj))
    return out


@pytest.mark.parametrize(("qualname", "obj"), public_callables(), ids=[q for q, _ in public_callables()])
def test_every_public_function_has_a_docstring(qualname: str, obj: Any) -> None:
    doc = inspect.getdoc(obj)
    assert doc and len(doc.splitlines()[0]) > 10, qualname
    if inspect.isfunction(obj) and not qualname.endswith(("get_advantage", "get_policy_loss")):
        assert "Returns:" in doc or "Returns" in doc, qualname


def test_public_functions_document_source_or_are_helpers() -> None:
    helpers = {
        "masked_mean",
        "get_advantage",
        "get_policy_loss",
        "get_kl_estimator",
        "get_aggregation",
        "get_kl_controller",
        "get_preference_loss",
        "fixed",
        "adaptive",
        "aggregate",
        "token_logprobs",
        "entropy_from_logits",
    }
    for qualname, obj in public_callables():
        if inspect.isfunction(obj) and qualname.rsplit(".", 1)[1] not in helpers:
            doc = inspect.getdoc(obj) or ""
            assert "Source:" in doc and "Degenerate:" in doc, qualname


def test_imports_only_torch_stdlib_and_itself() -> None:
    allowed = {"torch", "trainer"} | set(sys.stdlib_module_names) | {"__future__"}
    for path in Path(algorithms_pkg.__path__[0]).glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                roots = [node.module or ""]
            else:
                continue
            for root in roots:
                assert root.split(".")[0] in allowed, f"{path.name} imports {root}"
                if root.startswith("trainer"):
                    assert root.startswith("trainer.algorithms"), f"{path.name} imports {root}"


def test_no_item_calls_or_prints() -> None:
    # .item()/.tolist()/.cpu() force a device sync; the loop decides when to pay for it.
    for path in Path(algorithms_pkg.__path__[0]).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                assert not (isinstance(f, ast.Attribute) and f.attr in {"item", "tolist", "cpu"}), path.name
                assert not (isinstance(f, ast.Name) and f.id == "print"), path.name
