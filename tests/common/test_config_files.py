"""YAML configs and --set values a hostile or careless user writes (alias bombs, self-referring
aliases, lists, keys given twice, values that are not YAML): one bounded line each."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..conftest import REPO
from ..folder_helpers import one_line_error, run_module


# ----- 6, 8, 14. YAML: alias bombs, a list config with --set, a key given twice ---------------------
def alias_bomb(levels: int = 9) -> str:
    """Each level a list of nine aliases of the one before: 9^levels values in < 500 bytes."""
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + f"\ntraining:\n  lr: *a{levels - 1}\n"


CONFIG_LOADERS = [
    ("packed_transformers.finetune.config", "load_finetune_config"),
    ("packed_transformers.training.config", "load_config"),
]


@pytest.mark.parametrize("module, loader", CONFIG_LOADERS)
def test_an_alias_bomb_is_one_bounded_line_in_little_memory(tmp_path, module, loader):
    import importlib
    import tracemalloc

    from packed_transformers.common.config_schema import ConfigError

    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert len(path.read_bytes()) < 1024
    load = getattr(importlib.import_module(module), loader)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as caught:
            load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(caught.value)
    assert "aliases expand to more than 100,000 values" in message and len(message) < 300
    assert "\n" not in message and peak < 50 * 2**20


@pytest.mark.parametrize("module, loader", CONFIG_LOADERS)
def test_wrong_values_are_quoted_in_bounded_excerpts(tmp_path, module, loader):
    import importlib

    from packed_transformers.common.config_schema import ConfigError

    load = getattr(importlib.import_module(module), loader)
    path = tmp_path / "long.yaml"
    path.write_text("training:\n  seed: [" + ", ".join(["1"] * 5000) + "]\n")
    with pytest.raises(ConfigError, match=r"training.seed: expected an integer, got a list of 5000 items$"):
        load(path)
    path.write_text("training:\n  seed: '" + "y" * 5000 + "'\n")
    with pytest.raises(ConfigError, match=r"got 'yyyy.*\.\.\. \(5002 characters\)$"):
        load(path)


def test_self_referring_aliases_are_one_line(tmp_path):
    from packed_transformers.common.config_schema import ConfigError, read_yaml

    path = tmp_path / "loop.yaml"
    path.write_text("training: &t\n  seed: *t\n")
    with pytest.raises(ConfigError, match="an alias refers to the value that holds it"):
        read_yaml(path)


@pytest.mark.parametrize("module, loader", CONFIG_LOADERS)
def test_a_config_that_is_a_list_is_one_line_with_or_without_set(tmp_path, module, loader):
    import importlib

    from packed_transformers.common.config_schema import ConfigError

    load = getattr(importlib.import_module(module), loader)
    path = tmp_path / "list.yaml"
    path.write_text("- training\n- data\n")
    for assignments in ([], ["training.seed=3"]):
        with pytest.raises(ConfigError, match=r"list.yaml: expected a mapping of sections, got list$"):
            load(path, assignments)


@pytest.mark.parametrize("module, loader", CONFIG_LOADERS)
def test_a_key_given_twice_is_refused_as_json_lines_refuse_it(tmp_path, module, loader):
    import importlib

    from packed_transformers.common.config_schema import ConfigError

    load = getattr(importlib.import_module(module), loader)
    path = tmp_path / "twice.yaml"
    path.write_text("training:\n  seed: 1\n  seed: 2\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: key 'seed' is given twice in one mapping \(line 3\)"):
        load(path)
    path.write_text("training: {}\ntraining: {}\n")
    with pytest.raises(ConfigError, match=r"key 'training' is given twice"):
        load(path)
    # a merge key (<<) is YAML's way to override on purpose: still allowed
    path.write_text("base: &b {seed: 1}\n")
    from packed_transformers.common.config_schema import read_yaml

    path.write_text("training:\n  <<: {seed: 1}\n  seed: 2\n")
    assert read_yaml(path) == {"training": {"seed": 2}}


def test_a_set_value_that_is_not_yaml_is_one_line(tmp_path):
    from packed_transformers.common.config_schema import ConfigError
    from packed_transformers.finetune.config import load_finetune_config

    path = tmp_path / "c.yaml"
    path.write_text("training:\n  seed: 1\n")
    with pytest.raises(ConfigError, match=r"--set training.seed: not valid YAML"):
        load_finetune_config(path, ["training.seed=[1,"])


@pytest.mark.slow  # both commands in fresh interpreters
def test_both_commands_refuse_the_bomb_and_a_list_with_set_in_one_line(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n")
    for argv in (
        ["packed_transformers.finetune.train", "--config", bomb, "--output-dir", tmp_path / "o1"],
        [
            "packed_transformers.finetune.train",
            "--config",
            listed,
            "--output-dir",
            tmp_path / "o2",
            "--set",
            "training.seed=1",
        ],
    ):
        assert "bomb.yaml" in one_line_error(run_module(*argv)) or "list.yaml" in argv[2].name
    for config in (bomb, listed):
        done = subprocess.run(
            [sys.executable, "run_pretraining.py", "--config", str(config), "--output-dir", str(tmp_path / "p"),
             "--set", "training.seed=1"],
            cwd=REPO, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert config.name in one_line_error(done)
