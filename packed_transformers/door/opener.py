"""The one opener: a model folder's path in, one LoadedModel out, for every kind of run.

    open_folder(folder)                                        # predict, the server, pipelines: as the folder says
    open_folder(folder, AsTheFolderSays(pooling="mean"))       # embeddings of any encoder or decoder folder
    open_folder(folder, ForEmbedding(normalize=True))          # embeddings, whatever else the folder holds
    open_folder(ckpt, ForTraining("classification", ModelOptions(new_head=True, ...),
                                  config=checkpoint_config, label="model.init_checkpoint ckpt"))   # fine-tuning's start

One typed value per kind of caller (`Opening`) says how; each carries only what that kind sets.

Which opening a folder gets is decided here: a folder finetune.train wrote (finetune.json)
or any folder with a task head (config.json's architectures) opens with its head
(door.folder.load_finetuned); a sentence-transformers folder, or any folder given a
pooling, as an embedding model (door.embedding_folder.load_encoder); a checkpoint opened for
a task the caller names (fine-tuning) with the head ModelOptions allow. config.json is
read once on each of these ways and handed on; the length limit is computed here
(LoadedModel.max_length). ExampleError (one line) for a folder that cannot be run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from packed_transformers.door.folder_spec import (
    FINETUNE_INFO,
    JSONL_FIELDS,
    FolderSpec,
    TextFields,
    read_json_object,
)
from packed_transformers.door.loaded import LoadedModel

# The torch door (model/, door.folder, door.embedding_folder) is imported where a folder is
# opened with torch, never at import: an exported folder (door.exported_folder) opens here too,
# in a process that imports no torch.
if TYPE_CHECKING:
    from packed_transformers.door.folder import FolderTokenizer
    from packed_transformers.model.opening import ModelOptions


def _model_options():
    from packed_transformers.model.opening import ModelOptions

    return ModelOptions()


@dataclass(frozen=True)
class AsTheFolderSays:
    """predict, the server, pipelines and Ray's predict: a folder with a head opens with it; a
    sentence-transformers folder (modules.json), or any folder given a pooling, as an embedding
    model. attention_backend: the kernel (None: the inference default); device: where an
    embedding model is put (a model with a head moves with its Runner)."""

    pooling: str | tuple[str, ...] | None = None
    attention_backend: str | None = None
    device: str = "cpu"


@dataclass(frozen=True)
class ForEmbedding:
    """embed and Ray's embed: the folder as an embedding model whatever else it holds;
    pooling, normalize, max_length override sentence-transformers' settings where given."""

    pooling: str | tuple[str, ...] | None = None
    normalize: bool | None = None
    max_length: int | None = None
    device: str = "cpu"
    attention_backend: str | None = None


@dataclass(frozen=True)
class ForTraining:
    """Fine-tuning's start: a checkpoint opened for `task` (model.opening.TASKS) with the head
    `model` allows; config: its config.json as the caller read it (None: read here); label:
    how an error line names the folder (e.g. "model.init_checkpoint PATH")."""

    task: str
    model: ModelOptions = field(default_factory=_model_options)
    config: Mapping | None = None
    label: str | None = None
    # the tokenizer the job tokenized its data with (built once, before the model: the head's
    # size follows the labels it found); the LoadedModel carries it, and its token types are
    # the model's
    tokenizer: FolderTokenizer | None = None


Opening = AsTheFolderSays | ForEmbedding | ForTraining  # one typed value per kind of caller


def open_folder(folder, how: Opening = AsTheFolderSays()) -> LoadedModel:
    """The LoadedModel of `folder`, opened as `how` says (module docstring). A folder `packed
    export` wrote opens as it was exported (door.exported_folder), without torch."""
    from packed_transformers.door.exported_folder import is_exported, load_exported

    folder = Path(folder)
    if is_exported(folder) and not isinstance(how, ForTraining):
        return load_exported(folder)
    from packed_transformers.door.embedding_folder import load_encoder
    from packed_transformers.door.folder import load_finetuned

    if isinstance(how, ForTraining):
        return open_checkpoint(
            folder, how.task, how.model, dict(how.config) if how.config is not None else None, how.label,
            how.tokenizer,
        )  # fmt: skip
    if isinstance(how, ForEmbedding):
        return load_encoder(
            folder, how.pooling, how.normalize, how.max_length, how.device, how.attention_backend
        )
    if not isinstance(how, AsTheFolderSays):
        raise TypeError(f"open_folder: how is a {type(how).__name__}, not one of {Opening}")
    if not (folder / FINETUNE_INFO).is_file() and ((folder / "modules.json").is_file() or how.pooling):
        return load_encoder(folder, how.pooling, None, None, how.device, how.attention_backend)
    return load_finetuned(folder, how.attention_backend)


def open_checkpoint(
    folder: Path, task: str, options: ModelOptions, config: dict | None, label: str | None,
    tokenizer: FolderTokenizer | None = None,
):  # fmt: skip
    """A checkpoint opened to be fine-tuned for `task`: the model (a head absent from the file
    initialised where options.new_head), its positions as the length limit, and the tokenizer
    the job tokenized its data with (the job builds it first, as the run config says)."""
    from packed_transformers.door.folder import open_packed_model

    config = read_json_object(folder / "config.json") if config is None else config
    if tokenizer is not None:
        options = replace(options, token_types=tokenizer.token_types)
    opened = open_packed_model(folder, task, options, config, label)
    spec = FolderSpec(
        path=folder, source="config.json", task=task, labels=(), multi_label=False,
        max_sequence_length=opened.max_tokens, pack_length=None, too_long="truncate",
        fields=TextFields(**JSONL_FIELDS), qa=None, tokenizer="tokenizer.json",
        model_type=config.get("model_type"), name=folder.name, model_config=config,
    )  # fmt: skip
    if tokenizer is None:
        return LoadedModel(spec, opened.model, None, max_input_length=opened.max_tokens)
    return LoadedModel(
        spec, opened.model, tokenizer.tokenizer, tokenizer.vocab, tokenizer.token_types,
        max_input_length=opened.max_tokens, transformers_tokenizer=tokenizer.transformers_tokenizer,
    )  # fmt: skip


def classification_fields(folder):
    """The JSON-lines fields (folder_spec.TextFields) a classification folder reads, known without loading it: from
    finetune.json or an export's packed_export.json (each read here; config.json is not, so that
    a process parses it once); None for any other folder or task (its fields are known once it
    is opened). Lets predict read its input before the model loads."""
    from packed_transformers.common.choices import EXPORTED
    from packed_transformers.door.folder_spec import (
        FINETUNE_INFO,
        JSONL_FIELDS,
        TextFields,
        read_finetune_info,
    )

    folder = Path(folder)
    if (folder / EXPORTED).is_file():
        from packed_transformers.door.exported_folder import read_export

        spec = read_export(folder).spec
        task, fields = spec["task"], spec["fields"]
    elif (folder / FINETUNE_INFO).is_file():
        info = read_finetune_info(folder / FINETUNE_INFO)
        task, fields = info.get("task", "classification"), info.get("fields") or JSONL_FIELDS
    else:
        return None
    return (
        TextFields(fields["text"], fields.get("pair"), fields.get("label"))
        if task == "classification"
        else None
    )
