"""A fine-tuning checkpoint written before keys were added to the schema resumes (issue 108
item 7): at 6002aac a checkpoint of 5b4a0cd (before contrastive training) was refused with
`config differs ... in contrastive.scale, ...`, keys the user never set. A key the saved config
lacks ran at its default then and compares by it."""

from __future__ import annotations

from packed_transformers.components.run_state import RunState
from packed_transformers.finetune.checkpoint import FinetuneProgress
from packed_transformers.finetune.config import SCHEMA, load_finetune_config
from packed_transformers.finetune.run_folder import resume_differences

from ..conftest import REPO

CONFIG = REPO / "configs" / "finetune_bbc.yaml"


def saved_before(config: dict, section: str, *keys: str) -> RunState:
    """A checkpoint's state whose config lacks `section` (no keys given) or those of its keys."""
    old = {name: dict(values) for name, values in config.items()}
    if keys:
        for key in keys:
            del old[section][key]
    else:
        del old[section]
    return RunState(extra=FinetuneProgress(old))


def test_a_checkpoint_from_before_a_section_existed_resumes_at_its_defaults():
    config = load_finetune_config(CONFIG)
    assert "contrastive" in SCHEMA and config["contrastive"]  # the section added since 5b4a0cd
    assert resume_differences(config, saved_before(config, "contrastive")) == []
    assert resume_differences(config, saved_before(config, "optim", "weight_decay")) == []
    scale = SCHEMA["contrastive"]["scale"].default
    changed = load_finetune_config(CONFIG, [f"contrastive.scale={scale * 2}"])
    assert resume_differences(changed, saved_before(config, "contrastive")) == ["contrastive.scale"]
    decayed = load_finetune_config(CONFIG, ["optim.weight_decay=0.5"])
    assert resume_differences(decayed, saved_before(config, "optim", "weight_decay")) == [
        "optim.weight_decay"
    ]
