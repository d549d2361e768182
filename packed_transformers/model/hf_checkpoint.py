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

from packed_transformers.common.files import atomic_folder

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


def load_reference(class_name: str, folder: Path, new_head: bool = False, **kwargs):
    """(transformers model, loading info) of `class_name` from `folder`, loaded strictly
    (load_checked). A truncated or foreign model.safetensors is a ValueError naming the
    folder: safetensors raises its own SafetensorError, which callers that report OSError /
    ValueError would not catch."""
    return load_checked(hf_model_class(class_name), folder, new_head, **kwargs)


# Buffers that old checkpoints carry and new models rebuild (or the reverse): never weights.
IGNORED_KEY_SUFFIXES = ("position_ids",)


def load_checked(model_class, folder: Path, new_head: bool, **kwargs):
    """`model_class.from_pretrained(folder)` -> (model, loading info), refused in one line
    (ValueError naming the weights) unless every encoder weight of the model is in the file,
    every encoder weight of the file is used, and no shape differs; with `new_head=False`
    (inference) the task head must be in the file too and nothing else may be left over;
    with `new_head=True` (the start of fine-tuning) a head absent from the file is
    initialised, and other tasks' heads in the file (a pretraining checkpoint's) are dropped.
    transformers itself only logs these (MISSING / UNEXPECTED), and its log is silenced here."""
    from safetensors import SafetensorError

    try:
        try:
            model, info = model_class.from_pretrained(folder, output_loading_info=True, **kwargs)
        except RuntimeError as err:
            if "ignore_mismatched_sizes" not in str(err):
                raise
            # transformers' own message points to a report that is silenced: load again to
            # name the weights and their shapes
            retry = {**kwargs, "ignore_mismatched_sizes": True}
            model, info = model_class.from_pretrained(folder, output_loading_info=True, **retry)
    except SafetensorError as err:
        raise unreadable_weights(folder, err) from None
    problem = loading_problem(info, encoder_prefixes(model), new_head)
    if problem:
        raise ValueError(f"{folder}: {problem}")
    return model, info


# Names transformers renames on load (old TF-converted checkpoints): such a file goes
# through transformers' loader, which knows them.
LEGACY_NAME_PARTS = ("LayerNorm.gamma", "LayerNorm.beta")


def load_weights(
    model,
    folder: Path,
    config,
    new_head: bool = False,
    reference_class: str = "BertModel",
    reference_options: dict | None = None,
    base_model_only: bool = False,
) -> dict:
    """Load `folder`'s weights into `model`, a packed BERT model whose names are transformers'
    `reference_class`'s (`bert.*` plus its head's; base_model_only: the file is a bare
    BertModel's, compared without `bert.`), as strictly as load_checked; -> the loading info
    (missing / unexpected / mismatched keys, in the reference's names).

    Read straight from model.safetensors, by name, as transformers reads it (a bare
    BertModel's names take the `bert.` prefix of a task model and the reverse; what the
    model does not have is left over), without building a transformers model: that needs
    transformers' modeling code, seconds of start-up for a command that only runs the
    model. A folder without a single model.safetensors (sharded, or PyTorch's pickle
    format) or with legacy names goes through transformers' `reference_class`
    (load_reference) and the same checks."""
    folder = Path(folder)
    path = folder / "model.safetensors"
    state = read_safetensors(path, folder) if path.is_file() else None
    if state is None or any(part in name for name in state for part in LEGACY_NAME_PARTS):
        state, info = reference_state(
            reference_class, folder, config, new_head, reference_options or {}, base_model_only
        )
    else:
        own = model.state_dict()
        if base_model_only:
            own = {_strip(name, BASE_PREFIX): value for name, value in own.items()}
            state = {_strip(name, BASE_PREFIX): value for name, value in state.items()}
        elif not any(name.startswith(BASE_PREFIX) for name in state):
            state = {f"{BASE_PREFIX}{name}": value for name, value in state.items()}
        info = {
            "missing_keys": sorted(own.keys() - state.keys()),
            "unexpected_keys": sorted(state.keys() - own.keys()),
            "mismatched_keys": sorted(
                (name, tuple(state[name].shape), tuple(own[name].shape))
                for name in own.keys() & state.keys()
                if state[name].shape != own[name].shape
            ),
        }
        base = "" if base_model_only else BASE_PREFIX
        encoder = tuple(f"{base}{name}." for name, _ in model.bert.named_children() if name != "pooler")
        problem = loading_problem(info, encoder, new_head)
        if problem:
            raise ValueError(f"{folder}: {problem}")
        state = {
            (f"{BASE_PREFIX}{name}" if base_model_only else name): value
            for name, value in state.items()
            if name in own
        }
    adopt_weights(model, state, info, folder, level=logging.INFO)  # every weight of the model, from the file
    return info


BASE_PREFIX = "bert."


def reference_state(
    reference_class: str, folder: Path, config, new_head: bool, reference_options: dict, base_model_only: bool
) -> tuple[dict, dict]:
    """(the weights in a packed BERT model's names, loading info), loaded through
    transformers' `reference_class` (load_reference: load_checked's checks; a head absent
    from the file initialised where new_head). base_model_only: the reference is a bare
    BertModel, whose names take the packed model's `bert.` prefix."""
    reference, info = load_reference(
        reference_class, folder, new_head=new_head, config=config, **reference_options
    )
    state = reference.state_dict()
    if base_model_only:
        state = {f"{BASE_PREFIX}{name}": value for name, value in state.items()}
    return state, info


def _strip(name: str, prefix: str) -> str:
    return name[len(prefix) :] if name.startswith(prefix) else name


def read_safetensors(path: Path, folder: Path) -> dict:
    """{name: tensor} of a safetensors file; a truncated or foreign file is a ValueError
    naming the folder (safetensors raises its own SafetensorError)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except SafetensorError as err:
        raise unreadable_weights(folder, err) from None


def unreadable_weights(folder: Path, err) -> ValueError:
    """The one line for weights safetensors cannot read (its own SafetensorError, which
    callers that report OSError / ValueError would not catch)."""
    return ValueError(f"{folder}: the weights cannot be read ({err}; a truncated or damaged file?)")


def encoder_prefixes(model) -> tuple[str, ...]:
    """Weight-name prefixes of the encoder proper inside a transformers model (its base
    model's children but the pooler): 'bert.embeddings.', 'bert.encoder.' for a task model,
    'embeddings.', 'encoder.' for a bare BertModel."""
    base = getattr(model, "base_model", model)
    prefix = "" if base is model else f"{model.base_model_prefix}."
    return tuple(f"{prefix}{name}." for name, _ in base.named_children() if name != "pooler")


def loading_problem(info: dict, encoder: tuple[str, ...], new_head: bool) -> str | None:
    """Why transformers' loading info (missing / unexpected / mismatched keys) means the
    model would not be the folder's, in one line; None when it is (see load_checked)."""
    mismatched = sorted(info.get("mismatched_keys") or [], key=lambda m: m[0])
    if new_head:  # a head of another shape (other labels) is initialised anew, as the head is
        mismatched = [m for m in mismatched if m[0].startswith(encoder)]
    if mismatched:
        key, in_file, in_model = mismatched[0]
        more = f" (and {len(mismatched) - 1} more weights)" if len(mismatched) > 1 else ""
        return (
            f"weight {key} has shape {list(in_file)} in the file but {list(in_model)} in the model that "
            f"config.json describes{more}; the config and the weights are not the same model's"
        )

    def real(keys):
        return sorted(k for k in keys or () if not k.endswith(IGNORED_KEY_SUFFIXES))

    missing, unexpected = real(info.get("missing_keys")), real(info.get("unexpected_keys"))
    missing_encoder = [k for k in missing if k.startswith(encoder)]
    unexpected_encoder = [k for k in unexpected if k.startswith(encoder)]
    if missing_encoder or unexpected_encoder:
        parts = []
        if missing_encoder:
            parts.append(
                f"{len(missing_encoder)} encoder weights of the model are not in the file (e.g. {missing_encoder[0]})"
            )
        if unexpected_encoder:
            parts.append(
                f"{len(unexpected_encoder)} encoder weights in the file are not used (e.g. {unexpected_encoder[0]})"
            )
        return (
            "; ".join(parts)
            + ": config.json (its model_type, num_hidden_layers, ...) does not describe these "
            "weights; they would run with random or dropped layers"
        )
    if new_head:
        return None
    if missing:
        return (
            f"the model's head is not in the file ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): "
            "it would be random; this folder is not a model fine-tuned for this task (fine-tune it with "
            "finetune.train first)"
        )
    return None  # what is left over is another task's head (a pretraining head): unused, harmless


def read_config(folder: Path, overrides: dict, config_dict=None) -> BertConfig:
    """folder/config.json with `overrides` set; shape fields must match the checkpoint.
    config_dict: the file as the caller already read it (None: read here)."""
    if config_dict:
        config = BertConfig.from_dict(dict(config_dict))
    elif not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json; expected a Hugging Face BERT folder")
    else:
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


def quiet_transformers(verbose: bool = False) -> None:
    """transformers' load report and progress bars repeat what our log says in one line: off,
    unless the command was given --verbose (common.cli.add_verbose_option)."""
    if verbose:
        return
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
