"""The recipes installed with the package (common/recipes.py, commands/recipes.py; issue 110
item 1): a README config path or a config's name read from the installed copy where no such
file is here, said in one line; `packed recipes` writing configs/ and examples/ whole, never
replacing a user's."""

from __future__ import annotations

import json

import pytest

from packed_transformers.commands import recipes as recipes_command
from packed_transformers.common.config_schema import ConfigError, read_yaml
from packed_transformers.common.preflight import path_mistake
from packed_transformers.common.recipes import CONFIGS, shipped_config, shipped_config_names

from ..conftest import REPO


def test_the_repositorys_configs_and_examples_are_the_installed_ones():
    assert (REPO / "configs").resolve() == CONFIGS
    assert sorted(p.name for p in (REPO / "configs").glob("*.yaml")) == [
        f"{n}.yaml" for n in shipped_config_names()
    ]


@pytest.mark.parametrize("given", ["configs/finetune_own.yaml", "finetune_own.yaml", "finetune_own"])
def test_a_readme_path_or_a_name_finds_the_installed_config(given):
    assert shipped_config(given) == CONFIGS / "finetune_own.yaml"


@pytest.mark.parametrize("given", ["other/finetune_own.yaml", "configs/nope.yaml", "finetune_own.yml", ""])
def test_anything_else_is_no_shipped_config(given):
    assert shipped_config(given) is None


def test_a_dotted_name_is_found_whole():
    assert shipped_config("mlperf_graphcore_pod16_v2.0") == CONFIGS / "mlperf_graphcore_pod16_v2.0.yaml"


def test_read_yaml_reads_the_installed_copy_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert read_yaml("configs/finetune_own.yaml") == read_yaml(CONFIGS / "finetune_own.yaml")
    err = capsys.readouterr().err
    assert "reading the installed finetune_own.yaml" in err and err.count("\n") == 1, err
    # a file of that path here is the user's, and wins
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/finetune_own.yaml").write_text("training:\n  epochs: 9\n")
    assert read_yaml("configs/finetune_own.yaml") == {"training": {"epochs": 9}}
    with pytest.raises(
        ConfigError, match=r"configs/nope.yaml: file not found \(the shipped configs, by name: demo, "
    ):
        read_yaml("configs/nope.yaml")
    assert path_mistake("--config", "finetune_own", "config") is None
    assert "file not found (the shipped configs" in path_mistake("--config", "nope", "config")


def test_packed_recipes_writes_both_folders_and_never_replaces_them(tmp_path, capsys):
    assert recipes_command.main(["--output", str(tmp_path)]) == 0
    written = json.loads(capsys.readouterr().out)
    assert "examples/classify/new_texts.jsonl" in written["examples"] and "finetune_own" in written["configs"]
    for path in [*(REPO / "configs").iterdir(), *(REPO / "examples").rglob("*.*")]:
        if path.is_file() and "__pycache__" not in path.parts:
            relative = path.relative_to(REPO)
            assert (tmp_path / relative).read_bytes() == path.read_bytes(), relative
    (tmp_path / "configs/finetune_own.yaml").write_text("# mine\n")
    assert recipes_command.main(["--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "configs/ exists; nothing was written" in err and err.count("\n") == 1
    assert (tmp_path / "configs/finetune_own.yaml").read_text() == "# mine\n"
    assert not list(tmp_path.glob(".*tmp*"))  # nothing half-written beside them
