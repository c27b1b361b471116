"""The hand-written pages against the code they describe: settings, dataset formats, spec examples, the
`rlrun` command, the routes they name, and the Python client calls they show."""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import re
import shlex
import tomllib
import uuid
from pathlib import Path
from typing import Any, get_args

import pytest

from .markdown import (
    ROOT,
    Block,
    blocks,
    code_spans,
    doc_files,
    openapi,
    prose_files,
    read,
    rel,
    without_blocks,
)

PROSE = [pytest.param(p, id=rel(p)) for p in prose_files()]


def page(name: str) -> str:
    return read(ROOT / "docs" / name)


# Settings


def _table_rows(text: str, first_cell: str) -> dict[str, list[str]]:
    """Markdown table rows whose first cell matches ``first_cell``, by that cell (backticks dropped)."""
    rows: dict[str, list[str]] = {}
    for line in without_blocks(text).split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")] if line.startswith("|") else []
        if cells and re.fullmatch(first_cell, cells[0].strip("`")):
            rows[cells[0].strip("`")] = [c.strip() for c in cells]
    return rows


def _default(field: Any) -> Any:
    return field.default_factory() if field.default_factory is not None else field.default


def test_every_setting_is_documented_with_its_default() -> None:
    from api.settings import Settings

    prefix = Settings.model_config.get("env_prefix", "")
    rows = _table_rows(page("settings.md"), rf"{prefix}[A-Z0-9_]+")
    problems = []
    for name, field in sorted(Settings.model_fields.items()):
        env = f"{prefix}{name}".upper()
        if env not in rows:
            problems.append(f"{env} (api/settings.py) is missing from docs/settings.md's table")
            continue
        default, cell = _default(field), rows[env][1].strip("`")
        if default is None:
            continue  # derived from RLRUN_HOME: the cell says how
        if isinstance(default, bool):
            ok = cell == str(default).lower()
        elif isinstance(default, int | float):
            ok = re.fullmatch(r"-?[\d.]+(e-?\d+)?", cell) is not None and float(cell) == default
        elif isinstance(default, list | dict):
            ok = cell == json.dumps(default)
        else:
            ok = cell == str(default)
        if not ok:
            problems.append(f"{env}: docs/settings.md says default {cell!r}, api/settings.py has {default!r}")
    assert not problems, "\n".join(problems)


def _variables_in_code() -> set[str]:
    sources = [*ROOT.glob("api/**/*.py"), *ROOT.glob("rlrun/**/*.py"), *ROOT.glob("trainer/**/*.py")]
    sources += [*ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/*.py"), *ROOT.glob(".ci/*")]
    sources += [ROOT / "Makefile", ROOT / "docker-compose.yml", ROOT / "Dockerfile"]
    found: set[str] = set()
    for path in sources:
        if path.is_file() and "tests/docs" not in path.as_posix():
            found |= set(re.findall(r"RLRUN_[A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8")))
    return found


def test_every_variable_the_docs_name_exists() -> None:
    from api.settings import Settings

    known = {f"RLRUN_{n.upper()}" for n in Settings.model_fields} | _variables_in_code()
    problems = [
        f"{rel(p)} names {var}, which no code reads"
        for p in doc_files()
        for var in sorted(set(re.findall(r"RLRUN_[A-Z0-9_]*[A-Z0-9]", read(p))))
        if var not in known
    ]
    assert not problems, "\n".join(problems)


# Dataset kinds and formats


_EXAMPLE = re.compile(r"<!-- example kind=(\w+) format=(\w+) -->\s*$")


def _dataset_examples() -> list[tuple[str, str, Block, Block]]:
    found = []
    bs = blocks(page("datasets.md"))
    for i, block in enumerate(bs):
        match = _EXAMPLE.search(block.before)
        if match:
            assert i + 1 < len(bs), f"example {match[1]}/{match[2]} needs an input block and a stored block"
            found.append((match[1], match[2], block, bs[i + 1]))
    return found


def test_every_dataset_kind_is_documented() -> None:
    from rlrun.formats import DETECT_LINES, KIND_KEYS, MAX_ROW_DEPTH, NORMALIZERS

    text = page("datasets.md")
    examples = _dataset_examples()
    rows = _table_rows(text, r"[a-z_]+")
    for kind in NORMALIZERS:
        assert f"## `{kind}`" in text, f"dataset kind {kind!r} (api/ingest.py) has no section in datasets.md"
        assert kind in rows, f"dataset kind {kind!r} is missing from the table in datasets.md"
        tested = {fmt for k, fmt, _, _ in examples if k == kind}
        listed = set(re.findall(r"`(\w+)`", rows[kind][2]))
        assert tested, f"dataset kind {kind!r} has no tested example in datasets.md"
        assert listed == tested, f"{kind}: formats in the table {sorted(listed)} != examples {sorted(tested)}"
    for kind, keys in KIND_KEYS:
        for key in keys:
            assert f"`{key}`" in text, f"detection key {key!r} of {kind} is not in datasets.md"
    assert f"first {DETECT_LINES} lines" in text
    assert f"at most {MAX_ROW_DEPTH} levels" in text


def test_dataset_kinds_match_the_api() -> None:
    from rlrun.formats import NORMALIZERS

    body = openapi()["paths"]["/v1/datasets"]["post"]["requestBody"]["content"]
    kinds = body["multipart/form-data"]["schema"]["properties"]["kind"]["enum"]
    assert set(kinds) == set(NORMALIZERS)


@pytest.mark.parametrize(
    ("kind", "fmt", "line", "stored"),
    [pytest.param(*e, id=f"{e[0]}-{e[1]}") for e in _dataset_examples()],
)
def test_dataset_example_is_accepted_as_documented(kind: str, fmt: str, line: Block, stored: Block) -> None:
    from rlrun.formats import NORMALIZERS, parse_json_line

    assert len(line.body.strip().split("\n")) == 1, f"datasets.md line {line.line}: an example is one line"
    row, got = NORMALIZERS[kind](parse_json_line(line.body.strip().encode()))
    assert got == fmt, f"datasets.md line {line.line}: read as format {got!r}, documented as {fmt!r}"
    assert row == json.loads(stored.body), f"datasets.md line {stored.line}: stored row differs"


# Run specs in examples


_ZERO = str(uuid.UUID(int=0))


def _fill_placeholders(node: Any, key: str = "") -> Any:
    """A documented example made submittable: ``<DATASET>``-style ids become a UUID, ``run:<x>`` a run."""
    if isinstance(node, dict):
        return {k: _fill_placeholders(v, k) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill_placeholders(v, key) for v in node]
    if isinstance(node, str) and ("<" in node or node == "…"):
        if node.startswith("run:"):
            return f"run:{_ZERO}"
        if key.endswith("dataset_id") or node == "…":
            return _ZERO
    return node


def _json_bodies(text: str) -> list[tuple[int, Any]]:
    """JSON objects shown as run specs or pipelines: ```json blocks, and curl's -d '...' bodies."""
    found: list[tuple[int, Any]] = []
    for block in blocks(text):
        if block.lang == "json":
            try:
                found.append((block.line, json.loads(block.body)))
            except json.JSONDecodeError:
                continue
        elif block.lang in ("sh", "bash", "console", ""):
            for match in re.finditer(r"-d '(\{.*?\})'", block.body, re.S):
                body = re.sub(r"'\$\w+'|\"'\$\w+'\"", '"<DATASET>"', match[1])
                found.append((block.line, json.loads(body)))
    return [(n, b) for n, b in found if isinstance(b, dict) and ("algorithm" in b or "stages" in b)]


_SPECS = [(p, n, body) for p in prose_files() for n, body in _json_bodies(read(p))]
SPEC_EXAMPLES = [pytest.param(p, n, body, id=f"{rel(p)}:{n}") for p, n, body in _SPECS]


def test_the_docs_show_spec_examples() -> None:
    assert {"README.md", "docs/runs.md"} <= {rel(p) for p, _, _ in _SPECS}


@pytest.mark.parametrize(("path", "line", "body"), SPEC_EXAMPLES)
def test_spec_example_is_valid(path: Path, line: int, body: dict[str, Any]) -> None:
    from pydantic import ValidationError

    from trainer.specs import learning_problems, parse_spec

    body = _fill_placeholders(body)
    specs = [body]
    if "stages" in body:
        components = openapi()["components"]["schemas"]
        assert set(body) <= set(components["PipelineCreate"]["properties"])
        for stage in body["stages"]:
            assert set(stage) <= set(components["StageIn"]["properties"])
        specs = [stage["spec"] for stage in body["stages"]]
    for spec in specs:
        refused = None
        try:
            parsed = parse_spec(spec)
        except ValidationError as exc:
            refused = str(exc)
        assert refused is None, f"{rel(path)} line {line}: the example is refused:\n{refused}"
        assert not learning_problems(parsed), f"{rel(path)} line {line}: {learning_problems(parsed)}"


# The rlrun command


def _parser() -> argparse.ArgumentParser:
    """The parser of the `rlrun` console script, wherever pyproject.toml says its module is."""
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["rlrun"]
    module = importlib.import_module(target.split(":")[0])
    parser: argparse.ArgumentParser = module.build_parser()
    return parser


def _command_lines(text: str) -> list[str]:
    """Every `rlrun ...` invocation shown: lines of shell blocks and code spans that start with it."""
    lines: list[str] = []
    for block in blocks(text):
        if block.lang in ("sh", "bash", "console", ""):
            for line in block.body.replace("\\\n", " ").split("\n"):
                lines += re.split(r";|&&|(?<!&)&(?!&)", line.split(" #")[0])
    lines += code_spans(text)
    out = []
    for line in lines:
        line = line.strip()
        line = re.sub(r"^(?:\.venv/bin/|[A-Z_]+=\S+\s+)+", "", line)
        if line.startswith("rlrun ") and re.match(r"rlrun [a-z]", line):
            out.append(line)
    return out


def _placeholders(tokens: list[str]) -> list[str]:
    args = []
    for token in tokens:
        token = token.replace("[", "").replace("]", "")
        if not token or token == "...":
            continue
        args.append("1" if re.fullmatch(r"<[^>]*>|[A-Z][A-Z_]*", token) else token)
    return args


@pytest.mark.parametrize("path", PROSE)
def test_rlrun_lines_parse(path: Path) -> None:
    parser = _parser()
    names = {name for leaf in _leaf_commands(parser) for name in _prefixes(leaf)}
    problems = []
    for line in _command_lines(read(path)):
        if line.removeprefix("rlrun ") in names:
            continue  # the command named in prose (`rlrun datasets upload` checks ...), not a call
        try:
            parser.parse_args(_placeholders(shlex.split(line)[1:]))
        except SystemExit:
            problems.append(line)
    assert not problems, f"{rel(path)}: the rlrun command refuses:\n" + "\n".join(problems)


def _prefixes(command: str) -> list[str]:
    words = command.split()
    return [" ".join(words[:i]) for i in range(1, len(words) + 1)]


def _leaf_commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """'runs create' -> its option strings (the long form where there is one), for every leaf command."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        options = []
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                longs = [o for o in action.option_strings if o.startswith("--")]
                options.append((longs or action.option_strings)[0])
        return {" ".join(prefix): options}
    out: dict[str, list[str]] = {}
    for name, sub in subs[0].choices.items():
        out |= _leaf_commands(sub, (*prefix, name))
    return out


def test_cli_page_lists_every_command_and_option() -> None:
    text = page("cli.md")
    problems = []
    for command, options in sorted(_leaf_commands(_parser()).items()):
        if f"rlrun {command}" not in text:
            problems.append(f"`rlrun {command}` is missing from docs/cli.md")
        for option in options:
            if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text):
                problems.append(f"`rlrun {command} {option}` is missing from docs/cli.md")
    assert not problems, "\n".join(problems)


# Routes named in prose and in curl examples

# Routes the docs name as deliberately not served (a departure from OpenAI's API).
NOT_SERVED = {("GET", "/v1/files/{id}/content")}
_ROUTE = re.compile(r"\b(GET|POST|PUT|PATCH|DELETE) (/[\w{}<>/.:@-]*[\w}>])")
_CURL_URL = re.compile(r"localhost:8000(/[^\s'\"]*)")


def _operations() -> dict[tuple[str, str], dict[str, Any]]:
    schema = openapi()
    return {(m.upper(), p): op for p, item in schema["paths"].items() for m, op in item.items()}


def _shape(path: str) -> str:
    """A path with its parameters, whatever their spelling ({run_id}, {id}, <RUN>), as one placeholder."""
    return re.sub(r"\{[^}/]*\}|<[^>/]*>", "{}", path.split("?")[0].rstrip("/") or "/")


def _named_routes(text: str) -> list[tuple[str, str, list[str]]]:
    """(method, path, query names) for every route in the text: `GET /v1/...` and curl's URLs."""
    found: list[tuple[str, str, list[str]]] = [(m, p, []) for m, p in _ROUTE.findall(text)]
    for block in blocks(text):
        for line in block.body.replace("\\\n", " ").split("\n"):
            command = line.split(" #")[0]
            for url in _CURL_URL.findall(command):
                explicit = re.search(r"-X\s+([A-Z]+)", command)
                method = explicit[1] if explicit else "POST" if re.search(r"\s-[dF]\s", command) else "GET"
                query = url.split("?", 1)[1] if "?" in url else ""
                names = [kv.split("=")[0] for kv in query.split("&") if kv]
                found.append((method, url.split("?")[0], names))
    return found


@pytest.mark.parametrize("path", PROSE)
def test_named_routes_exist(path: Path) -> None:
    ops = _operations()
    by_shape = {(m, _shape(p)): op for (m, p), op in ops.items()}
    not_served = {(m, _shape(p)) for m, p in NOT_SERVED}
    problems = []
    for method, route, query in _named_routes(read(path)):
        key = (method, _shape(route))
        if key in not_served:
            assert key not in by_shape, f"{method} {route} is served now: update the docs that say it is not"
            continue
        op = by_shape.get(key)
        if op is None:
            problems.append(f"{method} {route} is no route of the API")
            continue
        params = {p["name"] for p in op.get("parameters", ()) if p["in"] == "query"}
        problems += [f"{method} {route}: no query parameter {q!r}" for q in query if q not in params]
    assert not problems, f"{rel(path)}:\n" + "\n".join(problems)


# Python examples


def _python_blocks() -> list[Any]:
    return [
        pytest.param(p, b, id=f"{rel(p)}:{b.line}")
        for p in prose_files()
        for b in blocks(read(p))
        if b.lang == "python"
    ]


@pytest.mark.parametrize(("path", "block"), _python_blocks())
def test_python_example_matches_the_client(path: Path, block: Block) -> None:
    from rlrun import Client

    tree = ast.parse(block.body)  # a syntax error fails here, naming the block
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "rlrun":
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                assert hasattr(module, alias.name), f"{rel(path)}:{block.line}: no {node.module}.{alias.name}"
    client = Client("http://127.0.0.1:9")  # nothing is sent: only the methods' signatures are read
    try:
        for node in ast.walk(tree):
            func = node.func if isinstance(node, ast.Call) else None
            if not (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Attribute)
                and isinstance(func.value.value, ast.Name)
                and func.value.value.id == "rl"
            ):
                continue
            assert isinstance(node, ast.Call)
            where = f"{rel(path)}:{block.line}: rl.{func.value.attr}.{func.attr}"
            namespace = getattr(client, func.value.attr, None)
            method = getattr(namespace, func.attr, None)
            assert callable(method), f"{where} does not exist"
            args = [None] * len(node.args)
            kwargs = {k.arg: None for k in node.keywords if k.arg is not None}
            try:
                inspect.signature(method).bind(*args, **kwargs)
            except TypeError as exc:
                pytest.fail(f"{where}: {exc}")
    finally:
        client.close()


def test_kinds_the_cli_offers_are_the_documented_ones() -> None:
    from api.schemas import DatasetKind

    text = page("cli.md")
    for kind in get_args(DatasetKind):
        assert f"`{kind}`" in text
