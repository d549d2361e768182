"""One name for a setting (issue 95): fine-tuning's device, threads and sharding are
`execution.*`, as in pretraining's configs; the old names are refused in one line that gives the
new one, in a file and in --set; a checkpoint written under the old names still resumes."""

from __future__ import annotations

import pytest

from packed_transformers.common.config_schema import ConfigError
from packed_transformers.components.run_state import RunState
from packed_transformers.finetune.checkpoint import FinetuneProgress
from packed_transformers.finetune.config import SCHEMA, load_finetune_config
from packed_transformers.finetune.run_folder import resume_differences
from packed_transformers.training.config import SCHEMA as PRETRAINING_SCHEMA

from ..conftest import REPO

CONFIG = REPO / "configs" / "finetune_bbc.yaml"


@pytest.mark.parametrize("old, new", [("device", "cpu"), ("threads", "2"), ("sharding", "none")])
def test_an_old_name_is_refused_with_the_new_one(tmp_path, old, new):
    with pytest.raises(ConfigError, match=rf"unknown key 'training.{old}'; it is now 'execution.{old}'"):
        load_finetune_config(CONFIG, [f"training.{old}={new}"])
    written = tmp_path / "old.yaml"
    written.write_text(CONFIG.read_text().replace("training:\n", f"training:\n  {old}: {new}\n", 1))
    with pytest.raises(ConfigError, match=rf"it is now 'execution.{old}'"):
        load_finetune_config(written)
    assert load_finetune_config(CONFIG, [f"execution.{old}={new}"])["execution"][old] is not None


def test_the_three_settings_share_pretraining_names():
    for name in ("device", "threads", "sharding"):
        assert name in SCHEMA["execution"] and name in PRETRAINING_SCHEMA["execution"]
        assert name not in SCHEMA["training"]


def test_a_checkpoint_written_under_the_old_names_resumes():
    config = load_finetune_config(CONFIG)
    old = {section: dict(values) for section, values in config.items() if section != "execution"}
    old["training"].update(device="cpu", threads=None, sharding="none")
    assert resume_differences(config, RunState(extra=FinetuneProgress(old))) == []
    old["training"]["device"] = "cuda"  # what did change is still named, under its new name
    assert resume_differences(config, RunState(extra=FinetuneProgress(old))) == ["execution.device"]
