"""What a sentence-transformers folder says about encoding, read once (standard library only):
modules.json (Transformer -> Pooling (-> Normalize)), the Pooling module's modes, the
Transformer's max_seq_length and do_lower_case, the prompts of
config_sentence_transformers.json. `describe_embedding_folder` is the door for an embedding
model, as door.folder_spec.describe_folder is for a model with a head: both give a
FolderSpec.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from packed_transformers.common.choices import check_pooling
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.door.folder_spec import EmbeddingSpec, FolderSpec, embedding_spec, read_json_object

# sentence-transformers' legacy pooling flags, in the order its Pooling concatenates them
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


def describe_embedding_folder(path, pooling=None) -> FolderSpec:
    """A sentence-transformers folder (its modules decide pooling, Normalize, max_seq_length,
    lower-casing, prompts; `pooling` given overrides its mode), or any encoder folder with
    `pooling` given (no normalisation; max length: the model's positions). The spec's
    max_sequence_length is the folder's own (None: the loader caps it by the positions)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ExampleError(f"{folder}: no config.json; expected a sentence-transformers or BERT folder")
    model_config = read_json_object(folder / "config.json")
    described = read_sentence_transformers(folder)
    if described is None and pooling is None:
        raise ExampleError(f"{folder}: no modules.json (not a sentence-transformers folder); give --pooling")
    try:
        modes = None if pooling is None else check_pooling(pooling)
    except ValueError as err:
        raise ExampleError(f"{folder}: {err}") from None
    if described is None:
        return embedding_spec(
            folder, EmbeddingSpec(modes, False), None, folder.name, "config.json", model_config
        )
    embedding, max_length = described
    return embedding_spec(
        folder, replace(embedding, pooling=modes or embedding.pooling), max_length, folder.name,
        model_config=model_config,
    )  # fmt: skip


def read_sentence_transformers(folder: Path) -> tuple[EmbeddingSpec, int | None] | None:
    """What a sentence-transformers folder says about encoding, and its max_seq_length (None:
    not said); None for a folder without modules.json. ExampleError (one line, naming the
    file and key) when it is malformed or holds modules packing cannot run."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExampleError(f"{modules_file}: not valid JSON ({err})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise ExampleError(f"{modules_file}: expected a list of objects with a 'type'")
    kinds = [str(m["type"]).rsplit(".", 1)[-1] for m in modules]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Normalize" for k in kinds[2:]):
        raise ExampleError(
            f"{modules_file}: modules {kinds}; packed encoding runs Transformer -> Pooling (-> Normalize)"
        )
    pooling_config = _json_file(folder / modules[1].get("path", "") / "config.json")
    if "pooling_mode" in pooling_config:
        modes = pooling_config["pooling_mode"]
    else:
        modes = [mode for key, mode in LEGACY_POOLING_KEYS.items() if pooling_config.get(key)] or ["mean"]
    if pooling_config.get("include_prompt", True) is not True:
        raise ExampleError(
            f"{folder / modules[1].get('path', '')}/config.json: include_prompt false is not supported"
        )
    try:
        modes = check_pooling(modes)
    except ValueError as err:
        raise ExampleError(f"{folder / modules[1].get('path', '')}/config.json: {err}") from None
    transformer_folder = folder / modules[0].get("path", "")
    transformer_config = _json_file(transformer_folder / "sentence_bert_config.json", {})
    # max_seq_length: sentence_bert_config.json (older folders), else the tokenizer's
    # model_max_length (where sentence-transformers 5+ saves it); capped by the positions later.
    max_length = transformer_config.get("max_seq_length")
    if max_length is None:
        max_length = _json_file(transformer_folder / "tokenizer_config.json", {}).get("model_max_length")
        max_length = max_length if isinstance(max_length, int) and 3 <= max_length < 1_000_000 else None
    if max_length is not None and (
        not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 3
    ):
        raise ExampleError(
            f"{transformer_folder}/sentence_bert_config.json: max_seq_length must be an integer >= 3, got {max_length!r}"
        )
    prompts, default_prompt = read_prompts(folder / "config_sentence_transformers.json")
    embedding = EmbeddingSpec(
        pooling=modes,
        normalize="Normalize" in kinds,
        lowercase=bool(transformer_config.get("do_lower_case", False)),
        prompts=prompts,
        default_prompt_name=default_prompt,
    )
    return embedding, max_length


def transformer_module_path(folder: Path) -> str:
    """Where a sentence-transformers folder keeps its Transformer module (its first, checked
    by read_sentence_transformers); "" (the folder itself) without modules.json."""
    modules_file = Path(folder) / "modules.json"
    return json.loads(modules_file.read_text())[0].get("path", "") if modules_file.is_file() else ""


def read_prompts(path: Path) -> tuple[dict, str | None]:
    """config_sentence_transformers.json's `prompts` {name: text} and `default_prompt_name`
    (e5-, bge- and nomic-style models ship them); ExampleError naming the key if malformed."""
    described = _json_file(path, {})
    prompts = described.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()
    ):
        raise ExampleError(f"{path}: key 'prompts' must be an object of name -> prompt text")
    default = described.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ExampleError(
            f"{path}: key 'default_prompt_name' is {default!r}, not one of its prompts {sorted(prompts)}"
        )
    return prompts, default


def _json_file(path: Path, default=None) -> dict:
    if not path.is_file():
        if default is not None:
            return default
        raise ExampleError(f"{path}: not found (the folder's modules.json names it)")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExampleError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ExampleError(f"{path}: expected a JSON object")
    return value
