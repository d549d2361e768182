"""The IPU path must import on the Poplar SDK 3.4 stack: Python 3.8 (Ubuntu 20.04; 3.10 on
Ubuntu 22.04) and torch 2.0.1 (requirements-ipu.txt). Neither runs here, so every module
`run_pretraining.py` can load on that path (the project-internal import closure of
`engines.ipu`, `training.run` and the command line, imports inside functions
included) is checked statically for what Python 3.8 cannot run:

* grammar newer than 3.8: `ast.parse(..., feature_version=(3, 8))` (match statements,
  parenthesised context managers, `except*`, ...; the docs call it best effort);
* expressions 3.8 evaluates and fails on: `X | Y` of types outside annotations (PEP 604,
  3.10), builtin generics such as `list[int]` outside annotations (PEP 585, 3.9), and
  annotations of either kind in a module without `from __future__ import annotations`;
* library calls added after 3.8: `zip(strict=)`, `dataclass(slots=, kw_only=)` (3.10),
  `str.removeprefix/removesuffix`, `functools.cache`, `math.lcm` (3.9),
  `itertools.pairwise` (3.10).

What it cannot show: that torch 2.0.1 has every torch API the path calls (the IPU test
set on a real SDK would), nor behaviour.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from ..conftest import REPO

# the rooms of packed_transformers the IPU path may reach (the package itself and its run script too)
PACKAGES = {
    "common",
    "packs",
    "packing",
    "data",
    "model",
    "optim",
    "components",
    "engines",
    "training",
    "finetune",
    "run_pretraining",
}
ROOTS = ("packed_transformers.engines.ipu", "packed_transformers.training.run",
         "packed_transformers.engines", "packed_transformers.run_pretraining", "run_pretraining")  # fmt: skip


def in_project(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "packed_transformers" and (len(parts) == 1 or parts[1] in PACKAGES)


BUILTIN_GENERICS = {"list", "dict", "tuple", "set", "frozenset", "type"}
TYPE_NAMES = {"int", "float", "str", "bool", "bytes", "list", "dict", "tuple", "set", "None"}
NEWER_ATTRIBUTES = {"removeprefix": "3.9", "removesuffix": "3.9", "pairwise": "3.10", "lcm": "3.9"}


def module_file(name: str) -> Path | None:
    for candidate in (REPO / f"{name.replace('.', '/')}.py", REPO / name.replace(".", "/") / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def project_imports(path: Path, name: str) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {f for f in found if in_project(f)}


@functools.lru_cache(maxsize=1)  # parsed once: every case below reads the closure
def ipu_path_modules() -> dict[str, Path]:
    seen: dict[str, Path] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        path = module_file(name)
        if name in seen or path is None:
            continue
        seen[name] = path
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(project_imports(path, name))
    return seen


def class_like(name: str) -> bool:
    """CapWords (a class), not ALL_CAPS (a constant: fcntl.LOCK_EX | fcntl.LOCK_NB is fine)."""
    return name[:1].isupper() and not name.isupper()


def type_like(node) -> bool:
    if isinstance(node, ast.Constant) and node.value is None:
        return True
    if isinstance(node, ast.Name):
        return node.id in TYPE_NAMES or class_like(node.id)
    if isinstance(node, ast.Attribute):
        return class_like(node.attr)
    if isinstance(node, ast.Subscript):
        return type_like(node.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return type_like(node.left) and type_like(node.right)
    return False


def annotation_nodes(tree) -> set[int]:
    """ids of every node inside an annotation (never evaluated with the __future__ import)."""
    inside = set()
    for node in ast.walk(tree):
        annotations = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            every = args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]
            annotations += [a.annotation for a in every if a is not None and a.annotation is not None]
            annotations.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        for annotation in filter(None, annotations):
            inside.update(id(n) for n in ast.walk(annotation))
    return inside


def problems(path: Path) -> list[str]:
    source = path.read_text()
    where = path.relative_to(REPO)
    try:
        tree = ast.parse(source, feature_version=(3, 8))
    except SyntaxError as err:
        return [f"{where}:{err.lineno}: grammar newer than Python 3.8 ({err.msg})"]
    future = any(
        isinstance(n, ast.ImportFrom)
        and n.module == "__future__"
        and any(a.name == "annotations" for a in n.names)
        for n in tree.body
    )
    in_annotation = annotation_nodes(tree) if future else set()
    found = []
    for node in ast.walk(tree):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        if id(node) in in_annotation:
            continue
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr) and type_like(node):
            found.append(f"{line}: `X | Y` of types is evaluated here (Python 3.10)")
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id in BUILTIN_GENERICS
        ):
            found.append(f"{line}: `{node.value.id}[...]` is evaluated here (Python 3.9)")
        elif isinstance(node, ast.Call):
            func = node.func
            keywords = {k.arg for k in node.keywords}
            if isinstance(func, ast.Name) and func.id == "zip" and "strict" in keywords:
                found.append(f"{line}: zip(strict=) (Python 3.10)")
            if isinstance(func, ast.Name) and func.id == "dataclass" and keywords & {"slots", "kw_only"}:
                found.append(f"{line}: dataclass(slots=/kw_only=) (Python 3.10)")
        elif isinstance(node, ast.Attribute) and node.attr in NEWER_ATTRIBUTES:
            found.append(f"{line}: .{node.attr} (Python {NEWER_ATTRIBUTES[node.attr]})")
        elif isinstance(node, ast.ImportFrom) and node.module == "functools":
            if any(a.name == "cache" for a in node.names):
                found.append(f"{line}: functools.cache (Python 3.9)")
    return found


def test_the_closure_holds_the_ipu_engine_and_what_it_runs():
    modules = ipu_path_modules()
    for name in ("packed_transformers.engines.ipu", "packed_transformers.engines.ipu_step", "packed_transformers.model.pretraining", "packed_transformers.optim.lamb",
                 "packed_transformers.components.step", "packed_transformers.packing.shards", "packed_transformers.common.files"):  # fmt: skip
        assert name in modules, name


@pytest.mark.parametrize("name", sorted(ipu_path_modules()))
def test_ipu_path_module_runs_on_python_3_8(name):
    path = ipu_path_modules()[name]
    assert problems(path) == []


def test_the_checker_finds_what_python_3_8_cannot_run(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.training.test_ipu_stack_python.REPO", tmp_path)
    cases = {
        "isinstance(x, int | float)\n": "X | Y",
        "from __future__ import annotations\nAlias = int | None\n": "X | Y",
        "def f(x: int | None): pass\n": "X | Y",  # no __future__ import: the annotation is evaluated
        "x = list[int]\n": "list[...]",
        "with (open('a') as a, open('b') as b):\n    pass\n": "grammar",
        "match x:\n    case 1:\n        pass\n": "grammar",
        "for a, b in zip(x, y, strict=True): pass\n": "zip(strict=)",
        "name = 'ab'.removeprefix('a')\n": "removeprefix",
        "Alias = Optional[int] | Tensor\n": "X | Y",
    }
    for source, expected in cases.items():
        path = tmp_path / "case.py"
        path.write_text(source)
        found = problems(path)
        assert found and expected in found[0], (source, found)
    fine = tmp_path / "fine.py"
    fine.write_text(
        "from __future__ import annotations\nimport fcntl\n"
        "def f(x: int | None) -> list[int]: return [x, fcntl.LOCK_EX | fcntl.LOCK_NB, 1 | 2]\n"
    )
    assert problems(fine) == []
