"""Hugging Face BERT folders in and out, shared by the packed pretraining and
classification models: config with checked overrides, weights adopted by name with a
loading report, atomic save."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import torch
from transformers import BertConfig

from common.files import atomic_folder

log = logging.getLogger(__name__)

# Overrides that must agree with a checkpoint: its weights have these shapes.
SHAPE_FIELDS = (
    "vocab_size",
    "max_position_embeddings",
    "type_vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)


def hf_model_class(name: str):
    """A transformers model class (BertForPreTraining, ...), imported on first use: the
    model classes pull in scipy and more that building and running a packed model never
    needs (ARCHITECTURE.md: `model` loads no scipy)."""
    import transformers

    return getattr(transformers, name)


def load_reference(class_name: str, folder: Path, **kwargs):
    """(transformers model, loading info) of `class_name` from `folder`. A truncated or
    foreign model.safetensors is a ValueError naming the folder: safetensors raises its own
    SafetensorError, which callers that report OSError / ValueError would not catch."""
    from safetensors import SafetensorError

    try:
        return hf_model_class(class_name).from_pretrained(folder, output_loading_info=True, **kwargs)
    except SafetensorError as err:
        raise ValueError(
            f"{folder}: the weights cannot be read ({err}; a truncated or damaged file?)"
        ) from None


def read_config(folder: Path, overrides: dict) -> BertConfig:
    """folder/config.json with `overrides` set; shape fields must match the checkpoint."""
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json; expected a Hugging Face BERT folder")
    config = BertConfig.from_pretrained(folder)
    for key, value in overrides.items():
        if key in SHAPE_FIELDS and getattr(config, key) != value:
            raise ValueError(
                f"{folder}: config asks for {key}={value}, but the checkpoint has {key}={getattr(config, key)}"
            )
        setattr(config, key, value)
    return config


def adopt_weights(model, state: dict, info: dict, folder: Path, tied=(), level=logging.WARNING) -> None:
    """Load the HF reference's `state` into `model` by name (every name must map, except the
    `tied` ones) and keep transformers' loading info in `model.loading_report`."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(f"{folder}: weight names do not map: missing {missing}, unexpected {unexpected}")
    model.loading_report = {k: list(v) for k, v in info.items() if v}
    if info.get("missing_keys"):
        log.log(
            level,
            "%s: initialised weights absent from the checkpoint: %s",
            folder,
            ", ".join(sorted(info["missing_keys"])),
        )


def reference_model(reference_class, config):
    """An HF model to save through. Building it runs its random init: kept off the global
    RNG so that saving never changes the run (dropout masks after it)."""
    with torch.random.fork_rng(devices=[]):
        return reference_class(config)


def save_as_reference(model, reference_class_name: str, folder, strip_prefix: str = "") -> None:
    """Save a packed head as the transformers class it mirrors (names must map one to one,
    after `strip_prefix`; HF's position_ids buffer aside), through `save_folder`."""
    reference = reference_model(hf_model_class(reference_class_name), model.config)
    cut = len(strip_prefix)
    state = {
        (name[cut:] if name.startswith(strip_prefix) else name): value
        for name, value in model.state_dict().items()
    }
    missing, unexpected = reference.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.endswith("position_ids")]:
        raise RuntimeError(f"save_pretrained: names differ: missing {missing}, unexpected {unexpected}")
    save_folder(reference, folder)


def save_folder(reference, folder) -> None:
    """reference.save_pretrained into a temporary folder, then renamed in as `folder`. A
    folder that already holds files (transformers' Trainer saves into its output and
    checkpoint folders, beside its own state) keeps them: each saved file is renamed in
    over its namesake, one by one, and nothing else there is touched."""
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.iterdir()):
        with atomic_folder(folder) as tmp:
            reference.save_pretrained(tmp)
        return
    with tempfile.TemporaryDirectory(prefix=f".{folder.name}.", dir=folder.parent) as tmp:
        reference.save_pretrained(tmp)
        for item in sorted(Path(tmp).iterdir()):
            os.replace(item, folder / item.name)


def quiet_transformers() -> None:
    """transformers' load report and progress bars repeat what our log says in one line."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
