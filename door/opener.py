"""The door from a folder to a LoadedModel where the caller does not know its kind (the
server, the Ray actors): an embedding folder opens through inference.embedding.load_encoder,
a folder with a head through door.folder.load_finetuned."""

from __future__ import annotations

from pathlib import Path

from door.folder import load_finetuned
from door.folder_spec import FINETUNE_INFO
from door.loaded import LoadedModel
from door.embedding_folder import load_encoder


def open_folder(
    folder, pooling=None, attention_backend: str | None = None, device: str = "cpu"
) -> LoadedModel:
    """The server's door: a sentence-transformers folder (or any folder
    given `pooling`, without finetune.json) opens as an embedding model, every other folder
    as the model with a head its finetune.json or config.json names. ExampleError (one line)
    for a folder that cannot be run."""
    folder = Path(folder)
    if not (folder / FINETUNE_INFO).is_file() and ((folder / "modules.json").is_file() or pooling):
        return load_encoder(folder, pooling, device=device, attention_backend=attention_backend)
    return load_finetuned(folder, attention_backend)
