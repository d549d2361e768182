"""Every name a bench script imports from the project exists where it imports it from.

`make bench` is not run by `make test` (minutes to hours); a module moved between rooms
(issue 72) broke bench/bench_finetune.py's imports unnoticed. Checked here statically:
each `from <project module> import <names>` of bench/*.py (at any depth, function-level
too) is resolved by importing the module in this process and reading the names."""

from __future__ import annotations

import ast
import importlib

import pytest

from ..conftest import REPO

PROJECT_ROOTS = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()} | {
    p.stem for p in REPO.glob("*.py")
}
BENCHES = sorted((REPO / "bench").glob("*.py"))


def project_imports(path):
    """[(line, module, name)] of the script's `from module import name` into the project."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in PROJECT_ROOTS | {"bench"}:
                found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return found


@pytest.mark.slow  # imports every bench dependency (seconds): make test, not the fast loop
@pytest.mark.parametrize("path", BENCHES, ids=lambda p: p.name)
def test_every_project_name_a_bench_imports_exists(path):
    missing = []
    for line, module, name in project_imports(path):
        try:
            imported = importlib.import_module(module)
        except ImportError as err:
            missing.append(f"{path.name}:{line}: {module}: {err}")
            continue
        if not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")  # a submodule
            except ImportError:
                missing.append(f"{path.name}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)


def test_the_checker_finds_a_moved_name(tmp_path):
    """The check is not vacuous: a planted import of a name that moved away is caught."""
    planted = tmp_path / "bench_planted.py"
    planted.write_text("from packed_transformers.finetune.train import build_classifier\n")
    assert project_imports(planted) == [(1, "packed_transformers.finetune.train", "build_classifier")]
    assert not hasattr(importlib.import_module("packed_transformers.finetune.train"), "build_classifier")
