"""The one opener: a model folder's path in, one LoadedModel out, for every kind of run.

    open_folder(folder)                                   # predict, the server, pipelines: as the folder says
    open_folder(folder, pooling="mean")                   # embeddings of any encoder or decoder folder
    open_folder(folder, task="embedding")                 # embeddings, whatever else the folder holds
    open_folder(ckpt, task="classification", model_options=ModelOptions(new_head=True, ...),
                config=checkpoint_config, label="model.init_checkpoint ckpt")   # fine-tuning's start

Which opening a folder gets is decided here: a folder finetune.train wrote (finetune.json)
or any folder with a task head (config.json's architectures) opens with its head
(door.folder.load_finetuned); a sentence-transformers folder, or any folder given a
pooling, as an embedding model (door.embedding_folder.load_encoder); a checkpoint opened for
a task the caller names (fine-tuning) with the head ModelOptions allow. config.json is
read once on each of these ways and handed on; the length limit is computed here
(LoadedModel.max_length). ExampleError (one line) for a folder that cannot be run.
"""

from __future__ import annotations

from pathlib import Path

from packed_transformers.door.embedding_folder import load_encoder
from packed_transformers.door.folder import load_finetuned, open_packed_model
from packed_transformers.door.folder_spec import (
    FINETUNE_INFO,
    JSONL_FIELDS,
    FolderSpec,
    TextFields,
    read_json_object,
)
from packed_transformers.door.loaded import LoadedModel
from packed_transformers.model.opening import ModelOptions


def open_folder(
    folder,
    pooling=None,
    attention_backend: str | None = None,
    device: str = "cpu",
    *,
    normalize: bool | None = None,
    max_length: int | None = None,
    task: str | None = None,
    model_options: ModelOptions | None = None,
    config: dict | None = None,
    label: str | None = None,
) -> LoadedModel:
    """The LoadedModel of `folder` (module docstring). pooling, normalize, max_length:
    an embedding model's (sentence-transformers' settings overridden where given); device:
    where an embedding model is put (the others move with their Runner); task "embedding":
    the folder as an embedding model whatever else it holds (finetune.embed); any other task
    with model_options: a checkpoint opened for that task (model.opening.TASKS), config its
    config.json as the caller read it, label how an error line names it."""
    folder = Path(folder)
    embedding = task == "embedding" or (
        task is None
        and not (folder / FINETUNE_INFO).is_file()
        and ((folder / "modules.json").is_file() or pooling)
    )
    if embedding:
        return load_encoder(folder, pooling, normalize, max_length, device, attention_backend)
    if task is not None:
        return open_checkpoint(folder, task, model_options or ModelOptions(), config, label)
    return load_finetuned(folder, attention_backend)


def open_checkpoint(folder: Path, task: str, options: ModelOptions, config: dict | None, label: str | None):
    """A checkpoint opened to be fine-tuned for `task`: the model (a head absent from the file
    initialised where options.new_head), its positions as the length limit, and no tokenizer
    (the job tokenizes its data before the model is opened, as the run config says)."""
    config = read_json_object(folder / "config.json") if config is None else config
    opened = open_packed_model(folder, task, options, config, label)
    spec = FolderSpec(
        path=folder, source="config.json", task=task, labels=(), multi_label=False,
        max_sequence_length=opened.max_tokens, pack_length=None, too_long="truncate",
        fields=TextFields(**JSONL_FIELDS), qa=None, tokenizer="tokenizer.json",
        model_type=config.get("model_type"), name=folder.name, model_config=config,
    )  # fmt: skip
    return LoadedModel(spec, opened.model, None, max_input_length=opened.max_tokens)
