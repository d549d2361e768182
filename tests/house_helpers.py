"""The package's import graph as the tests read it: product rooms, import circles, config reads.

Shared by several test modules (no test module imports another)."""

from __future__ import annotations

import ast
from pathlib import Path

from .conftest import PACKAGE

PRODUCT_PACKAGES = (
    "common",
    "data",
    "packs",
    "packing",
    "model",
    "optim",
    "components",
    "engines",
    "training",
    "door",
    "inference",
    "finetune",
    "ray_jobs",
    "hf_integration",
    "serving",
    "commands",
)


def import_graph(packages=PRODUCT_PACKAGES) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports, at the top or inside a function (a
    function's import is a runtime edge all the same)."""
    graph = {}
    for package in packages:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            parts = path.relative_to(PACKAGE).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            edges = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                else:
                    continue
                # names inside the package, as the rooms see each other
                targets = [t.removeprefix("packed_transformers.") for t in targets]
                edges |= {
                    t
                    for t in targets
                    if t.split(".")[0] in packages
                    and (
                        (PACKAGE / (t.replace(".", "/") + ".py")).is_file()
                        or (PACKAGE / t.replace(".", "/") / "__init__.py").is_file()
                    )
                }
            graph[name] = edges - {name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def config_reads(open_it, folder) -> int:
    """How often Python opens `folder`/config.json while `open_it()` runs, as the first run of
    the process (door.folder_spec reads a file once per process: what earlier tests read is
    forgotten first)."""
    import builtins
    from unittest import mock

    from packed_transformers.door import folder_spec

    folder_spec._READ_ONCE.clear()

    target = (folder / "config.json").resolve()
    real_open, reads = builtins.open, []

    def counting_open(file, *args, **kwargs):
        if isinstance(file, str | bytes) or hasattr(file, "__fspath__"):
            if Path(file).resolve() == target:
                reads.append(file)
        return real_open(file, *args, **kwargs)

    with mock.patch("builtins.open", counting_open), mock.patch("io.open", counting_open):
        open_it()
    return len(reads)


def counted_run(argv, folder, output: Path, plant: str | None = None, timeout: float = 300):
    """`python -m packed_transformers ARGV` as a user runs it (a fresh interpreter, cold: the
    warm launcher's server has imported transformers already), with tests/counting/ on
    PYTHONPATH: returns (the finished process, {"config_json": opens of folder/config.json,
    "tokenizer_builds": transformers tokenizers built}) over the whole process. plant:
    "config" or "tokenizer", a second reader planted after the door (the count must see it)."""
    import json
    import subprocess
    import sys

    from .conftest import REPO

    env, counts = counting_environment(folder, output, plant)
    done = subprocess.run([sys.executable, "-m", "packed_transformers", *map(str, argv)], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=timeout)  # fmt: skip
    return done, json.loads(counts.read_text()) if counts.exists() else None


def counting_environment(folder, output: Path, plant: str | None = None) -> tuple[dict, Path]:
    """The environment of a counted command (counted_run) and the file its counts land in at exit."""
    import os

    from .conftest import REPO

    counts = output / "counts.json"
    env = dict(os.environ, PYTHONPATH=str(REPO / "tests" / "counting"), COUNT_FOLDER=str(folder),
               COUNT_OUTPUT=str(counts), PACKED_TESTS_COLD="1")  # fmt: skip
    env.pop("COUNT_PLANT", None)
    if plant:
        env["COUNT_PLANT"] = plant
    return env, counts
