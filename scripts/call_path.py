"""How often a reader following a DPO spec from ``run_dpo`` into its loss comes back to a file it had left.

A static *reading walk*: it models a person reading the source, not the program running (nothing is
imported or executed, so it reads any checkout, e.g. a worktree of an older commit, with ``--root``).

The walk, exactly:

- It starts at ``trainer.loops.dpo.run_dpo`` and reads a function's source in order: its signature
  (defaults), then its body top to bottom, a function defined inside it read where it stands (a call to
  such a nested function is not followed again). Calls are met in source order (line, then column:
  ``f(g(x))`` meets ``f`` before ``g``).
- A call is *followed* when its target resolves to a function or method defined in a project file under
  ``trainer/`` that has not been read yet: the reader reads that function (depth-first, the same way) and
  comes back. A target resolves through the calling module's imports (re-exports through a package's
  ``__init__`` followed to the definition) and its own functions and classes; ``self.method`` (and
  ``cls.method``) in a method of a project class, looked up through its project base classes;
  ``x.method`` where ``x``'s class is known from an annotation (parameter, variable, dataclass field,
  ``self.x: T``), from ``x = SomeClass(...)`` or ``x = f(...)`` with ``f``'s return annotation naming a
  project class (``A | B``: the first project class named), or from an attribute chain of those
  (``session.sampler.next_batch()``). A class called as a constructor is its ``__init__`` (its own or a
  project base's).
- Not followed: library code (torch, transformers, the standard library); a ``Protocol``'s stubs (a
  ``Reporter``'s methods have no body to read); a class with no project ``__init__`` (a dataclass: its
  fields are read where they are used); properties and other attribute reads (not calls); callables held
  in variables or fields (``self.compute(...)``, ``ctx.resolve_model(...)``).
- Hops: the reader moves freely inside a file, but goes at most one file away from ``run_dpo``'s
  (``--hops``): a helper in another file is read, with the functions of its own file it calls, and its
  calls into a third file are taken on trust (read from their names), as a person following one path
  does. ``--hops 0``: no limit.
- ``trainer/distributed.py`` (rank arithmetic: ``unwrap``, ``share``, ``is_sharded`` ...) is not read
  at all (``--ignore FILE`` names others instead, ``--count-all`` none); functions in
  ``trainer/algorithms/`` are read but never descended from.
- The walk ends on arriving in ``trainer/algorithms/preference_losses.py``, the loss (``--until``;
  ``--until ''`` reads ``run_dpo`` to its end).

A *stay* is a maximal run of reading in one file. Going into a function in another file starts a stay
there; coming back to the caller starts a new stay in the caller's file when the caller has source left
after the call; consecutive stays in one file are one stay. A *return* is a stay in a file that had an
earlier stay: returns = stays - distinct files.

Calibration (issue 36 counted 33 stays, 12 files, 21 returns by hand at 92c0fae, "mostly between dpo.py,
session.py and common.py"): these choices give 42 stays, 12 files, 30 returns there, the same files and
dpo.py / session.py / common.py as the files returned to most. Reading every call to any depth gives
136 / 18 / 118; one hop but counting distributed.py 50 / 13 / 37; no hop limit 78 / 17 / 61.

Printed: stays, distinct files, returns, then the sequence of files (``--verbose``: with the functions
read in each stay; ``--quiet``: the three numbers only)::

    .venv/bin/python scripts/call_path.py
    git worktree add /tmp/walk-base 92c0fae && .venv/bin/python scripts/call_path.py --root /tmp/walk-base
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

FuncNode = ast.FunctionDef | ast.AsyncFunctionDef
START = ("trainer.loops.dpo", "run_dpo")
STOP_UNDER = "trainer/algorithms/"
LOSS_FILE = "trainer/algorithms/preference_losses.py"
IGNORED = ("trainer/distributed.py",)


@dataclass
class Klass:
    """A project class: its methods, its bases (as written) and the types of its attributes."""

    module: Module
    node: ast.ClassDef
    methods: dict[str, FuncNode] = field(default_factory=dict)
    fields: dict[str, ast.expr] = field(default_factory=dict)  # annotation, or the assigned value
    protocol: bool = False

    @property
    def qualname(self) -> str:
        return f"{self.module.name}.{self.node.name}"


@dataclass
class Module:
    name: str
    path: str  # relative to the root
    tree: ast.Module
    functions: dict[str, FuncNode] = field(default_factory=dict)
    classes: dict[str, Klass] = field(default_factory=dict)
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # local -> (module, name)
    globals_: dict[str, ast.expr] = field(default_factory=dict)  # module-level NAME = value / annotation


@dataclass(frozen=True)
class Ref:
    """What an expression stands for: a module, a function, a class, or an instance of a class."""

    kind: str  # "module" | "function" | "class" | "instance"
    module: str
    name: str = ""  # function or class name ("Class.method" for a method)


class Project:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: dict[str, Module] = {}
        for path in sorted((root / "trainer").rglob("*.py")):
            rel = path.relative_to(root)
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            self.modules[name] = self._index(name, str(rel), ast.parse(path.read_text(), str(rel)))

    def _index(self, name: str, path: str, tree: ast.Module) -> Module:
        mod = Module(name, path, tree)
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in tree.body:
            self._index_statement(mod, node, package)
        return mod

    def _index_statement(self, mod: Module, node: ast.stmt, package: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            mod.functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            mod.classes[node.name] = self._index_class(mod, node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    mod.imports[alias.asname] = (alias.name, None)
                else:
                    top = alias.name.split(".")[0]
                    mod.imports[top] = (top, None)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                mod.imports[alias.asname or alias.name] = (base, alias.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    mod.globals_[target.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            mod.globals_[node.target.id] = node.annotation
        elif isinstance(node, ast.If):  # TYPE_CHECKING blocks and the like
            for inner in node.body + node.orelse:
                self._index_statement(mod, inner, package)

    def _index_class(self, mod: Module, node: ast.ClassDef) -> Klass:
        klass = Klass(mod, node)
        klass.protocol = any(ast.unparse(b).split(".")[-1].startswith("Protocol") for b in node.bases)
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                klass.methods[item.name] = item
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                klass.fields[item.target.id] = item.annotation
        for method in klass.methods.values():  # self.x = ... / self.x: T = ... in any method
            for sub in ast.walk(method):
                if isinstance(sub, ast.AnnAssign) and _self_attr(sub.target):
                    klass.fields.setdefault(_self_attr(sub.target) or "", sub.annotation)
                elif isinstance(sub, ast.Assign):
                    for target in sub.targets:
                        for t, v in _pairs(target, sub.value):
                            attr = _self_attr(t)
                            if attr and v is not None:
                                klass.fields.setdefault(attr, v)
        return klass

    # -- name resolution -------------------------------------------------------------------------------

    def lookup(self, module: str, name: str, seen: frozenset[tuple[str, str]] = frozenset()) -> Ref | None:
        """What ``name`` is in ``module``'s namespace (following imports and re-exports)."""
        if (module, name) in seen:
            return None
        mod = self.modules.get(module)
        if mod is None:
            return Ref("module", f"{module}.{name}") if f"{module}.{name}" in self.modules else None
        if name in mod.functions:
            return Ref("function", module, name)
        if name in mod.classes:
            return Ref("class", module, name)
        if name in mod.imports:
            source, attr = mod.imports[name]
            if attr is None:
                return Ref("module", source) if source in self.modules or source == "trainer" else None
            if f"{source}.{attr}" in self.modules:
                return Ref("module", f"{source}.{attr}")
            return self.lookup(source, attr, seen | {(module, name)})
        if f"{module}.{name}" in self.modules:
            return Ref("module", f"{module}.{name}")
        return None

    def klass(self, ref: Ref) -> Klass | None:
        mod = self.modules.get(ref.module)
        return mod.classes.get(ref.name) if mod else None

    def bases(self, klass: Klass) -> list[Klass]:
        out = []
        for base in klass.node.bases:
            ref = Scope(self, klass.module, None, None).resolve(base)
            if ref is not None and ref.kind == "class" and (k := self.klass(ref)) is not None:
                out.append(k)
        return out

    def method(self, klass: Klass, name: str) -> tuple[Klass, FuncNode] | None:
        """``name`` on ``klass`` or its first project base that defines it."""
        if name in klass.methods:
            return klass, klass.methods[name]
        for base in self.bases(klass):
            found = self.method(base, name)
            if found is not None:
                return found
        return None

    def field_type(self, klass: Klass, name: str) -> Ref | None:
        for k in [klass, *self.bases(klass)]:
            if name in k.fields:
                expr = k.fields[name]
                scope = Scope(self, k.module, k, None)
                is_annotation = any(
                    isinstance(i, ast.AnnAssign) and i.annotation is expr for i in ast.walk(k.node)
                )
                return scope.annotation(expr) if is_annotation else scope.type_of(expr)
            found = self.method(k, name)
            if found is not None and _is_property(found[1]):
                return Scope(self, found[0].module, found[0], found[1]).annotation(found[1].returns)
        return None


class Scope:
    """Names as seen from inside ``func`` (None: module level) of ``module``, in class ``klass``."""

    def __init__(
        self,
        project: Project,
        module: Module,
        klass: Klass | None,
        func: FuncNode | None,
        outer: Scope | None = None,
    ) -> None:
        self.project, self.module, self.klass, self.func, self.outer = project, module, klass, func, outer
        self.types: dict[str, ast.expr | None] = {}  # local name -> its annotation, or its value
        self.annotated: set[str] = set()
        self.nested: set[str] = set()
        if func is not None:
            args = func.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                if arg.annotation is not None:
                    self.types[arg.arg] = arg.annotation
                    self.annotated.add(arg.arg)
            for sub in _own_nodes(func):
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    self.nested.add(sub.name)
                elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                    self.types[sub.target.id] = sub.annotation
                    self.annotated.add(sub.target.id)
                elif isinstance(sub, ast.Assign | ast.For | ast.With | ast.NamedExpr):
                    for target, value in _bindings(sub):
                        if target not in self.annotated:
                            self.types.setdefault(target, value)

    def resolve(self, expr: ast.expr) -> Ref | None:
        """What ``expr`` refers to (a module, function, class, or an instance)."""
        if isinstance(expr, ast.Name):
            return self._name(expr.id)
        if isinstance(expr, ast.Attribute):
            base = self.resolve(expr.value)
            if base is None:
                return None
            if base.kind == "module":
                return self.project.lookup(base.module, expr.attr)
            if base.kind in ("class", "instance") and (k := self.project.klass(base)) is not None:
                found = self.project.method(k, expr.attr)
                if found is not None and not _is_property(found[1]):
                    owner, node = found
                    return Ref("function", owner.module.name, f"{owner.node.name}.{node.name}")
                if base.kind == "instance":
                    return self.project.field_type(k, expr.attr)
            return None
        if isinstance(expr, ast.Call):
            return self.type_of(expr)
        return None

    def _name(self, name: str) -> Ref | None:
        scope: Scope | None = self
        while scope is not None and scope.func is not None:
            if name in scope.nested:
                return Ref("nested", scope.module.name, name)
            if name in ("self", "cls") and scope.klass is not None and scope.outer is None:
                kind = "instance" if name == "self" else "class"
                return Ref(kind, scope.klass.module.name, scope.klass.node.name)
            if name in scope.types:
                expr = scope.types[name]
                if name in scope.annotated:
                    return scope.annotation(expr)
                return scope.type_of(expr) if expr is not None else None
            scope = scope.outer
        ref = self.project.lookup(self.module.name, name)
        if ref is None and name in self.module.globals_:
            return Scope(self.project, self.module, None, None).type_of(self.module.globals_[name])
        return ref

    def type_of(self, value: ast.expr) -> Ref | None:
        """The instance a value expression makes, where the walk can tell."""
        if isinstance(value, ast.Call):
            callee = self.resolve(value.func)
            if callee is None:
                return None
            if callee.kind == "class":
                return Ref("instance", callee.module, callee.name)
            if callee.kind == "function":
                node = self.project_function(callee)
                if node is not None and node[1].returns is not None:
                    mod = self.project.modules[callee.module]
                    return Scope(self.project, mod, node[0], node[1]).annotation(node[1].returns)
            return None
        ref = self.resolve(value)
        return ref if ref is not None and ref.kind == "instance" else None

    def annotation(self, expr: ast.expr | None) -> Ref | None:
        """The first project class an annotation names (``A | None``, ``"A"``, ``Optional[A]``)."""
        if expr is None:
            return None
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            try:
                expr = ast.parse(expr.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
            return self.annotation(expr.left) or self.annotation(expr.right)
        if isinstance(expr, ast.Subscript) and ast.unparse(expr.value).split(".")[-1] == "Optional":
            return self.annotation(expr.slice)
        ref = Scope(self.project, self.module, None, None).resolve(expr)
        if ref is not None and ref.kind == "class":
            return Ref("instance", ref.module, ref.name)
        return None

    def project_function(self, ref: Ref) -> tuple[Klass | None, FuncNode] | None:
        mod = self.project.modules.get(ref.module)
        if mod is None:
            return None
        owner, _, name = ref.name.rpartition(".")
        if not owner:
            node = mod.functions.get(name)
            return (None, node) if node is not None else None
        klass = mod.classes.get(owner)
        if klass is None or name not in klass.methods:
            return None
        return klass, klass.methods[name]


@dataclass
class Walk:
    project: Project
    hops: int | None = 1  # files a reader goes away from run_dpo's file (None: no limit)
    ignore: tuple[str, ...] = IGNORED  # files whose functions are not read at all
    until: str | None = LOSS_FILE  # the walk ends on arriving in this file
    stays: list[tuple[str, list[str]]] = field(default_factory=list)  # file, functions read in the stay
    read: set[int] = field(default_factory=set)
    arrived: bool = False

    def here(self, path: str, what: str | None = None) -> None:
        if not self.stays or self.stays[-1][0] != path:
            self.stays.append((path, []))
        if what is not None:
            self.stays[-1][1].append(what)

    def read_function(self, module: Module, klass: Klass | None, func: FuncNode, level: int) -> None:
        self.read.add(id(func))
        if self.until is not None and module.path == self.until:
            self.arrived = True
        name = f"{klass.node.name}.{func.name}" if klass else func.name
        self.here(module.path, name)
        if module.path.startswith(STOP_UNDER):
            return
        self.read_body(Scope(self.project, module, klass, func), func, level)

    def read_body(self, scope: Scope, func: FuncNode | ast.Lambda, level: int) -> None:
        scopes: dict[int, Scope] = {}
        for call, owner in sorted(_calls(func), key=lambda c: (c[0].lineno, c[0].col_offset)):
            if self.arrived:
                return
            inner = scope
            if owner is not func:  # a call inside a nested function or lambda sees that one's names
                assert isinstance(owner, ast.FunctionDef | ast.AsyncFunctionDef)
                inner = scopes.setdefault(id(owner), self._nested_scope(scope, func, owner))
            target = self.target(inner, call)
            if target is None:
                continue
            mod, klass, node = target
            hops = level + (mod.path != scope.module.path)  # files away from run_dpo's
            if self.hops is not None and hops > self.hops:
                continue  # taken on trust
            self.read_function(mod, klass, node, hops)
            if self.arrived:
                return
            if self.stays[-1][0] != scope.module.path and (func.end_lineno or 0) > (call.end_lineno or 0):
                self.here(scope.module.path)  # back in the caller, with lines left to read

    def _nested_scope(self, scope: Scope, func: FuncNode | ast.Lambda, owner: FuncNode) -> Scope:
        chain = _path_to(func, owner)
        for node in chain:
            scope = Scope(self.project, scope.module, scope.klass, node, outer=scope)
        return scope

    def target(self, scope: Scope, call: ast.Call) -> tuple[Module, Klass | None, FuncNode] | None:
        ref = scope.resolve(call.func)
        if ref is None:
            return None
        if ref.kind == "class":
            klass = self.project.klass(ref)
            found = self.project.method(klass, "__init__") if klass else None
            if found is None:
                return None
            owner, node = found
            if owner.module.path in self.ignore:
                return None
            return self._unread(owner.module, owner, node)
        if ref.kind != "function":
            return None
        found_fn = scope.project_function(ref)
        if found_fn is None:
            return None
        klass_, node = found_fn
        if klass_ is not None and klass_.protocol:
            return None
        if self.project.modules[ref.module].path in self.ignore:
            return None
        return self._unread(self.project.modules[ref.module], klass_, node)

    def _unread(
        self, module: Module, klass: Klass | None, node: FuncNode
    ) -> tuple[Module, Klass | None, FuncNode] | None:
        return None if id(node) in self.read else (module, klass, node)


def _own_nodes(func: FuncNode) -> list[ast.AST]:
    """The nodes of ``func``'s body, nested functions' bodies excluded (their names included)."""
    out: list[ast.AST] = []
    stack: list[ast.AST] = list(func.body)
    while stack:
        node = stack.pop()
        out.append(node)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        stack.extend(ast.iter_child_nodes(node))
    return out


def _calls(func: FuncNode | ast.Lambda) -> list[tuple[ast.Call, ast.AST]]:
    """Every call in ``func`` (signature defaults, body, nested functions and lambdas), with the function
    whose names it sees."""
    out: list[tuple[ast.Call, ast.AST]] = []

    def visit(node: ast.AST, owner: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else owner
            if isinstance(child, ast.Call):
                out.append((child, owner))
            visit(child, inner)

    visit(func, func)
    return out


def _path_to(func: ast.AST, target: ast.AST) -> list[FuncNode]:
    """The nested functions from ``func`` (excluded) down to ``target`` (included)."""
    for child in ast.iter_child_nodes(func):
        if child is target:
            return [target] if isinstance(target, ast.FunctionDef | ast.AsyncFunctionDef) else []
        found = _path_to(child, target)
        if found or _contains(child, target):
            head = [child] if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else []
            return head + found
    return []


def _contains(node: ast.AST, target: ast.AST) -> bool:
    return any(n is target for n in ast.walk(node))


def _bindings(node: ast.AST) -> list[tuple[str, ast.expr | None]]:
    if isinstance(node, ast.Assign):
        return [
            (t.id, v)
            for target in node.targets
            for t, v in _pairs(target, node.value)
            if isinstance(t, ast.Name)
        ]
    if isinstance(node, ast.NamedExpr):
        return [(node.target.id, node.value)]
    if isinstance(node, ast.With):
        return [(i.optional_vars.id, None) for i in node.items if isinstance(i.optional_vars, ast.Name)]
    if isinstance(node, ast.For):
        return [(n.id, None) for n in ast.walk(node.target) if isinstance(n, ast.Name)]
    return []


def _pairs(target: ast.expr, value: ast.expr | None) -> list[tuple[ast.expr, ast.expr | None]]:
    """``a, b = x, y`` -> (a, x), (b, y); an unpacked call's parts have no known value."""
    if isinstance(target, ast.Tuple | ast.List):
        values = value.elts if isinstance(value, ast.Tuple | ast.List) else None
        if values is not None and len(values) == len(target.elts):
            return [p for t, v in zip(target.elts, values, strict=True) for p in _pairs(t, v)]
        return [p for t in target.elts for p in _pairs(t, None)]
    return [(target, value)]


def _self_attr(target: ast.expr) -> str | None:
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
        return target.attr
    return None


def _is_property(func: FuncNode) -> bool:
    return any(ast.unparse(d).split(".")[-1] in ("property", "cached_property") for d in func.decorator_list)


def walk(
    root: Path,
    hops: int | None = 1,
    ignore: tuple[str, ...] = IGNORED,
    until: str | None = LOSS_FILE,
) -> list[tuple[str, list[str]]]:
    """The stays of the reading walk from ``run_dpo`` in the checkout at ``root``: (file, functions read)."""
    project = Project(root)
    module = project.modules[START[0]]
    w = Walk(project, hops, ignore, until)
    w.read_function(module, None, module.functions[START[1]], 0)
    return w.stays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--hops", type=int, default=1, help="files away from run_dpo's (0: no limit)")
    parser.add_argument(
        "--ignore", action="append", default=None, help=f"a file not read at all (default {IGNORED})"
    )
    parser.add_argument("--count-all", action="store_true", help="no file ignored")
    parser.add_argument("--until", default=LOSS_FILE, help="the walk ends on arriving here ('': read on)")
    parser.add_argument("--verbose", action="store_true", help="the functions read in each stay")
    parser.add_argument("--quiet", action="store_true", help="the three numbers only")
    args = parser.parse_args(argv)
    ignore = () if args.count_all else tuple(args.ignore) if args.ignore is not None else IGNORED
    stays = walk(args.root, args.hops or None, ignore, args.until or None)
    files = list(dict.fromkeys(path for path, _ in stays))
    out = sys.stdout
    out.write(f"stays {len(stays)}, files {len(files)}, returns {len(stays) - len(files)}\n")
    if not args.quiet:
        for i, (path, functions) in enumerate(stays, 1):
            mark = "  (return)" if path in (p for p, _ in stays[: i - 1]) else ""
            detail = f": {', '.join(functions)}" if args.verbose and functions else ""
            out.write(f"{i:3d} {path}{mark}{detail}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
