"""What a model folder says about running it, read once into one typed value: the door from
a folder the user names to what predict, the server and the Ray actors run (door.folder
then loads the model and tokenizer it describes). No torch: the preflight asks it too.

    spec = describe_folder("runs/bbc/model")
    spec.task, spec.labels, spec.fields.text, spec.max_sequence_length, spec.qa

Two folder kinds: finetune.train's (finetune.json: task, labels, multi-label, lengths, the
input fields, QA settings) and any folder transformers' save_pretrained wrote (config.json's
architectures, id2label and problem_type; the tokenizer's model_max_length; transformers'
pipelines' defaults for the rest). Each file is read once; a malformed one is one
ExampleError naming the file and key.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from packed_transformers.common.cli import first_line
from packed_transformers.data.classification_data import ExampleError


@dataclass(frozen=True)
class TextFields:
    """The JSON-lines fields a folder reads: its text, optional pair, optional label."""

    text: str
    pair: str | None
    label: str | None


@dataclass(frozen=True)
class EmbeddingSpec:
    """How a folder's texts become vectors (a sentence-transformers folder's modules.json and
    its modules' configs, or the options given for a bare encoder): pooling modes in
    sentence-transformers' order, L2 normalisation (its Normalize module), lower-casing
    before tokenizing (do_lower_case), the prompts {name: text} and the default prompt's name
    (config_sentence_transformers.json)."""

    pooling: tuple[str, ...]
    normalize: bool
    lowercase: bool = False
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None


@dataclass(frozen=True)
class FolderSpec:
    """A model folder, described (describe_folder).

    path: the folder (None for a model built in memory, a SentenceTransformer's);
    source: "finetune.json" (finetune.train's folder) | "config.json" (any transformers
    folder) | "modules.json" (a sentence-transformers folder); task: classification |
    token_classification | question_answering | embedding; labels: class names in index
    order (() for QA and embeddings); max_sequence_length: tokens per text (QA: the window;
    embeddings: max_seq_length, None until the loader caps it by the model's positions);
    pack_length: tokens per pack, None = from the lengths; too_long: truncate | error; qa:
    doc_stride, n_best_size, max_answer_length, version_2_with_negative,
    null_score_diff_threshold (QA only); tokenizer: "vocab.txt" (finetune.train's WordPiece)
    or "tokenizer.json" (the folder's own); model_type: config.json's (None: not read here);
    config: the run config a finetune.json keeps ({} otherwise); embedding: how texts become
    vectors (task embedding only); name: the model's name in responses (the folder's);
    model_config: config.json as read once here ({} where the folder has none), handed to
    the loader (model.opening.open_model) so that nothing reads it again; length_cap: the
    folder's own limit on a text's tokens beyond the model's positions (a transformers
    folder's tokenizer model_max_length; None for finetune.train's folders, which take new
    text up to the positions: door.folder computes LoadedModel.max_input_length from it)."""

    path: Path | None
    source: str
    task: str
    labels: tuple[str, ...]
    multi_label: bool
    max_sequence_length: int | None
    pack_length: int | None
    too_long: str
    fields: TextFields
    qa: Mapping | None
    tokenizer: str
    model_type: str | None = None
    config: Mapping | None = None
    embedding: EmbeddingSpec | None = None
    name: str = ""
    model_config: Mapping = field(default_factory=dict)
    length_cap: int | None = None


def describe_folder(path) -> FolderSpec:
    """The folder's FolderSpec; ExampleError (one line naming the file and key) for a folder
    that is not there or that predict cannot run."""
    folder = Path(path)
    if not folder.is_dir():
        raise ExampleError(f"{folder}: no such folder" if not folder.exists() else f"{folder}: not a folder")
    info_path = folder / FINETUNE_INFO
    own = info_path.is_file()
    config_path = folder / "config.json"
    model_config = read_json_object(config_path) if config_path.is_file() else {}
    info = read_finetune_info(info_path) if own else describe_hub_folder(folder, model_config)
    fields = info.get("fields") or JSONL_FIELDS
    return FolderSpec(
        path=folder,
        source=FINETUNE_INFO if own else "config.json",
        task=info["task"],
        labels=tuple(info.get("labels") or ()),
        multi_label=bool(info.get("multi_label", False)),
        max_sequence_length=int(info["max_sequence_length"]),
        pack_length=info.get("pack_length"),
        too_long=info.get("too_long", "truncate"),
        fields=TextFields(fields["text"], fields.get("pair"), fields.get("label")),
        qa=info.get("qa"),
        tokenizer=info.get("tokenizer", "vocab.txt") if own else "tokenizer.json",
        model_type=info.get("model_type"),
        config=info.get("config") or {},
        name=folder.name,
        model_config=model_config,
        length_cap=info.get("length_cap"),
    )


def embedding_spec(
    path: Path | None,
    embedding: EmbeddingSpec,
    max_length: int | None,
    name: str,
    source: str = "modules.json",
    model_config: Mapping | None = None,
) -> FolderSpec:
    """The FolderSpec of an embedding model: one text field, no labels, truncation as
    sentence-transformers truncates."""
    return FolderSpec(
        path=path, source=source, task="embedding", labels=(), multi_label=False, max_sequence_length=max_length,
        pack_length=None, too_long="truncate", fields=TextFields("text", None, None), qa=None,
        tokenizer="tokenizer.json", embedding=embedding, name=name, model_config=model_config or {},
    )  # fmt: skip


FINETUNE_INFO = "finetune.json"


REQUIRED_INFO = {
    "classification": ("labels", "multi_label", "max_sequence_length", "fields"),
    "question_answering": ("max_sequence_length", "qa"),
}


def _info_type_problem(info: dict, task: str) -> str | None:
    """What is of the wrong type in a finetune.json, or None."""

    def text_or_none(value):
        return value is None or isinstance(value, str)

    length = info["max_sequence_length"]
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        return f"'max_sequence_length' must be an integer >= 1, got {length!r}"
    if task == "question_answering":
        return None if isinstance(info["qa"], dict) else f"'qa' must be an object, got {info['qa']!r}"
    labels, fields = info["labels"], info["fields"]
    if not isinstance(labels, list) or not labels or not all(isinstance(x, str) for x in labels):
        return f"'labels' must be a non-empty list of strings, got {labels!r}"
    if not isinstance(info["multi_label"], bool):
        return f"'multi_label' must be true or false, got {info['multi_label']!r}"
    if (
        not isinstance(fields, dict)
        or not isinstance(fields.get("text"), str)
        or not all(text_or_none(fields.get(key)) for key in ("pair", "label"))
    ):
        return f"'fields' must be an object with a string 'text' and string or null 'pair' and 'label', got {fields!r}"
    return None


# config.json's architecture suffix -> the task predict and the server run it as
ARCHITECTURE_TASKS = {
    "ForSequenceClassification": "classification",
    "ForTokenClassification": "token_classification",
    "ForQuestionAnswering": "question_answering",
}


# bert runs on this project's own packed BERT (model/); the other families on transformers'
# modules with packed attention (model/families.py).
# Where a folder carries no finetune.json: transformers' pipelines' defaults (documented in
# docs/finetune.md, "Any folder transformers saved").
PIPELINE_QA = {
    "doc_stride": 128,  # QuestionAnsweringPipeline's: min(window // 2, 128)
    "n_best_size": 20,
    "max_answer_length": 15,  # QuestionAnsweringPipeline's max_answer_len
    "version_2_with_negative": False,  # handle_impossible_answer=False
    "null_score_diff_threshold": 0.0,
}


PIPELINE_QA_WINDOW = 384  # QuestionAnsweringPipeline's max_seq_len


JSONL_FIELDS = {"text": "text", "pair": "text_pair", "label": "label"}  # the pipelines' dict input


def has_own_tokenizer(folder: Path) -> bool:
    """A fast tokenizer's file, or what transformers converts into one (sentencepiece)."""
    return (
        (folder / "tokenizer.json").is_file()
        or any(folder.glob("*.model"))
        or (folder / "merges.txt").is_file()
    )


def read_finetune_info(info_path: Path) -> dict:
    """finetune.json, checked (ExampleError names the file and field)."""
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
        task = info.get("task", "classification")  # folders from before QA carry no task
        needed = REQUIRED_INFO.get(task)
        if needed is None:
            raise ExampleError(f"{info_path}: task {task!r} is not one of {sorted(REQUIRED_INFO)}")
        missing = [key for key in needed if key not in info]
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError) as err:
        raise ExampleError(f"{info_path}: not a {FINETUNE_INFO} written by finetune.train ({err})") from None
    if missing:
        raise ExampleError(f"{info_path}: fields {missing} are missing")
    problem = _info_type_problem(info, task)
    if problem:
        raise ExampleError(f"{info_path}: {problem} (an edited or foreign {FINETUNE_INFO})")
    info["task"] = task
    return info


# Each file read once per process: (real path, device, inode, mtime in ns, size) -> its object.
# A command's preflight (before torch is imported) and the door after it ask for the same
# config.json; a file changed in between has another identity and is read again.
_READ_ONCE: dict[tuple, dict] = {}


def read_json_object(path: Path) -> dict:
    """A JSON object from `path` (a copy: the caller may change it), or ExampleError naming the
    file. Parsed once per process while the file stays as it was (_READ_ONCE)."""
    try:
        stat = os.stat(path)
        identity = (os.path.realpath(path), stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if identity not in _READ_ONCE:
            _READ_ONCE[identity] = json.loads(Path(path).read_text(encoding="utf-8"))
        value = _READ_ONCE[identity]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExampleError(f"{path}: not readable JSON ({first_line(err)[:120]})") from None
    if not isinstance(value, dict):
        raise ExampleError(f"{path}: expected a JSON object")
    return copy.deepcopy(value)


def task_of_architectures(config: dict, config_path: Path) -> str:
    """The task predict runs a transformers folder as, from config.json's `architectures`
    (ARCHITECTURE_TASKS); ExampleError naming the key otherwise. No torch: the preflight asks
    it too, before the imports."""
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ExampleError(f"{config_path}: key 'architectures' must be a list of class names")
    task = next(
        (t for a in architectures for suffix, t in ARCHITECTURE_TASKS.items() if a.endswith(suffix)), None
    )
    if task is None:
        raise NoHead(
            f"{config_path}: key 'architectures' is {architectures}; predict runs a "
            "*ForSequenceClassification, *ForTokenClassification or *ForQuestionAnswering folder "
            "(for embeddings of a bare encoder use `packed embed --pooling mean`)",
            config_path, architectures,
        )  # fmt: skip
    return task


class NoHead(ExampleError):
    """A transformers folder whose config.json names no head a command runs: predict's line
    as the message; `config_path` and `architectures` for a command that words its own."""

    def __init__(self, message: str, config_path, architectures):
        super().__init__(message)
        self.config_path, self.architectures = config_path, architectures


def predict_folder_mistake(folder: Path) -> str | None:
    """What predict would refuse in a folder before loading it, or None: a transformers folder
    (no finetune.json) whose config.json names no head predict runs."""
    config_path = Path(folder) / "config.json"
    if (Path(folder) / FINETUNE_INFO).is_file() or not config_path.is_file():
        return None  # finetune.train's folders, and what the command says after its imports
    try:
        task_of_architectures(read_json_object(config_path), config_path)
    except ExampleError as err:
        return str(err)
    return None


def describe_hub_folder(folder: Path, config: dict) -> dict:
    """What a folder without finetune.json says about running it, from config.json (`config`,
    as read; {} where the folder has none) and the tokenizer's files, with transformers'
    pipelines' defaults for the rest."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ExampleError(
            f"{folder}: no config.json and no {FINETUNE_INFO}; expected a folder written by "
            "finetune.train or by transformers' save_pretrained"
        )
    task = task_of_architectures(config, config_path)
    from packed_transformers.model.families import usable_positions
    from packed_transformers.model.opening import supported_model_types

    model_type = config.get("model_type")
    if model_type not in supported_model_types():  # the door's table, read once here
        raise ExampleError(
            f"{config_path}: key 'model_type' is {model_type!r}, not a packed model family (encoder or decoder); supported: "
            f"{', '.join(supported_model_types())}"
        )
    positions = config.get("max_position_embeddings", config.get("n_positions"))  # GPT-2 names it n_positions
    if not isinstance(positions, int) or positions < 3:
        raise ExampleError(f"{config_path}: key 'max_position_embeddings' must be an integer >= 3")
    positions = usable_positions(model_type, positions, config.get("pad_token_id"))
    if not has_own_tokenizer(folder) and not (folder / "vocab.txt").is_file():
        raise ExampleError(f"{folder}: no tokenizer.json (nor vocab.txt); save the tokenizer with the model")
    # The tokenizer's model_max_length (transformers' truncation limit), capped by the positions.
    model_max = {}
    if (folder / "tokenizer_config.json").is_file():
        model_max = read_json_object(folder / "tokenizer_config.json")
    length = model_max.get("model_max_length")
    length = length if isinstance(length, int) and 3 <= length <= positions else positions
    labels = label_names(config, config_path)
    problem = config.get("problem_type")
    info = {
        "task": task,
        "labels": labels,
        "multi_label": problem == "multi_label_classification",
        "max_sequence_length": length,
        "pack_length": None,
        "too_long": "truncate",
        "fields": dict(JSONL_FIELDS),
        "source": "config.json",
        "model_type": model_type,
        "length_cap": length,  # the tokenizer's model_max_length, capped by the positions
    }
    if task == "question_answering":
        window = min(PIPELINE_QA_WINDOW, length)
        info["max_sequence_length"] = window
        # the pipeline's doc_stride: min(max_seq_len // 2, 128)
        info["qa"] = {**PIPELINE_QA, "doc_stride": min(window // 2, PIPELINE_QA["doc_stride"])}
    return info


def label_names(config: dict, config_path: Path) -> list[str]:
    """id2label in index order (num_labels names; LABEL_i where a name is missing, as
    transformers names them)."""
    id2label = config.get("id2label") or {}
    if not isinstance(id2label, dict):
        raise ExampleError(f"{config_path}: key 'id2label' must be an object of index -> name")
    try:
        named = {int(k): str(v) for k, v in id2label.items()}
    except ValueError:
        raise ExampleError(f"{config_path}: key 'id2label' has a key that is not an index") from None
    count = config.get("num_labels", len(named) or 2)
    count = max(named, default=-1) + 1 if named else count
    return [named.get(i, f"LABEL_{i}") for i in range(count)]
