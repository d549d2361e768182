"""The fine-tuned model folder: what `finetune.train` writes and `finetune.predict` reads.

FOLDER/
    config.json, model.safetensors   Hugging Face BertForSequenceClassification, or
                                     BertForQuestionAnswering (task question_answering)
    vocab.txt                        the vocabulary the model was trained with
    tokenizer.json, tokenizer_config.json   question answering: the fast tokenizer, so that
                                     transformers' AutoTokenizer loads the folder as is
    finetune.json                    task; classification: labels, multi_label,
                                     max_sequence_length, pack_length, too_long, input field
                                     names; QA: max_sequence_length, pack_length and the qa
                                     settings (doc_stride, n_best_size, max_answer_length,
                                     v2.0); the whole run config
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.cli import first_line
from common.files import write_json_atomic
from data.classification_data import ExampleError
from data.tokenizer import load_tokenizer

FINETUNE_INFO = "finetune.json"
# A tokenizer's files as transformers saves them (copied with a model trained on its tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
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


def save_finetuned(
    model,
    config: dict,
    label_names: list[str] | None,
    vocab_file: Path | None,
    folder: Path,
    tokenizer=None,
    tokenizer_source: Path | None = None,
) -> None:
    """HF weights, then the tokenizer (vocab.txt, or, when `vocab_file` is None, the tokenizer
    files of `tokenizer_source`, the checkpoint) and what predict needs to read new text the
    same way."""
    model.save_pretrained(folder)
    data = config["data"]
    own_tokenizer = vocab_file is None
    if own_tokenizer:  # the checkpoint's tokenizer files (tokenizer_source), as they are
        for name in TOKENIZER_FILES:
            if (tokenizer_source / name).is_file():
                shutil.copyfile(tokenizer_source / name, folder / name)
    else:
        shutil.copyfile(vocab_file, folder / "vocab.txt")
    if data["task"] == "question_answering":
        tokenizer.save_pretrained(folder)
        write_json_atomic(
            folder / FINETUNE_INFO,
            {
                "task": data["task"],
                "max_sequence_length": data["max_sequence_length"],
                "pack_length": config["batching"]["pack_length"],
                "qa": config["qa"],
                "config": config,
            },
        )
        return
    write_json_atomic(
        folder / FINETUNE_INFO,
        {
            "task": data["task"],
            "labels": label_names,
            "multi_label": data["multi_label"],
            "max_sequence_length": data["max_sequence_length"],
            "pack_length": config["batching"]["pack_length"],
            "too_long": data["too_long"],
            "fields": {"text": data["text_field"], "pair": data["pair_field"], "label": data["label_field"]},
            "tokenizer": "tokenizer.json" if own_tokenizer else "vocab.txt",
            "config": config,
        },
    )


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


@dataclass
class ModelFolder:
    """A loaded model folder: the packed model, what finetune.json (or, without it,
    config.json and the tokenizer) says about running it (`info`: task, labels,
    multi_label, max_sequence_length, fields, too_long, qa), and its tokenizer.

    `tokenizer` is the folder's own fast tokenizer (tokenizer.json: its normalizer,
    special tokens and pair template) where the folder has one, else the WordPiece of its
    vocab.txt, as finetune.train tokenized it (`vocab` is then that vocabulary)."""

    folder: Path
    model: object
    info: dict
    tokenizer: object  # a tokenizers.Tokenizer
    vocab: dict | None
    token_types: bool = True  # whether the folder's tokenizer hands the model token_type_ids

    def tokenize(self, examples, labels, max_sequence_length: int, too_long: str):
        """Examples -> TokenizedExamples, as this folder's tokenizer makes them."""
        from data.classification_data import tokenize, tokenize_by_template

        if self.vocab is not None:
            return tokenize(examples, self.tokenizer, self.vocab, labels, max_sequence_length, too_long)
        data = tokenize_by_template(examples, self.tokenizer, labels, max_sequence_length, too_long)
        if not self.token_types:  # transformers feeds the model zeros then: so do we
            data.segment_ids = [np.zeros_like(s) for s in data.segment_ids]
        return data

    def hf_tokenizer(self):
        """transformers' fast tokenizer of the folder (QA windows need its overflow and offsets)."""
        if self.vocab is not None:
            from data.qa_windows import fast_tokenizer

            return fast_tokenizer(self.vocab)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.folder)


def load_finetuned(folder: Path, attention_backend: str | None = None) -> ModelFolder:
    """A model folder for predict and the server: a `finetune.train` output (finetune.json)
    or any folder transformers' `save_pretrained` wrote with a sequence-classification,
    token-classification or question-answering head (task from config.json's
    `architectures`, labels from `id2label`, multi-label from `problem_type`, tokenization
    by the folder's tokenizer.json). attention_backend overrides BERT's (every backend
    computes the same outputs). ExampleError (one line, naming the file and key) for a folder
    that cannot be run."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ExampleError(f"{folder}: no such folder" if not folder.exists() else f"{folder}: not a folder")
    info_path = folder / FINETUNE_INFO
    info = read_finetune_info(info_path) if info_path.is_file() else describe_hub_folder(folder)
    model = load_packed_model(folder, info["task"], attention_backend)
    if info_path.is_file() and info.get("tokenizer", "vocab.txt") == "vocab.txt":
        # finetune.train's own folders: the WordPiece it trained with, exactly
        tokenizer, vocab = load_tokenizer(folder / "vocab.txt")
        check_vocabulary_fits(folder, tokenizer, model)
        return ModelFolder(folder, model, info, tokenizer, vocab)
    # Any other folder: the tokenizer transformers builds from whatever files it has (a
    # vocab.txt-only folder keeps tokenizer_config.json's do_lower_case, cased or not).
    tokenizer = folder_tokenizer(folder)
    check_vocabulary_fits(folder, tokenizer, model)
    return ModelFolder(folder, model, info, tokenizer, None, hands_token_types(folder))


def load_packed_model(folder: Path, task: str, attention_backend: str | None = None):
    """The packed model of a folder for `task` ("classification" | "token_classification" |
    "question_answering"), through the one door (model.opening.open_model), loaded strictly
    (its head must be in the file). attention_backend: BERT's (every backend computes the
    same outputs). ExampleError (one line) for weights that are a pickle, a model_type the
    door does not hold, or a folder that cannot be loaded."""
    from model.families import UnsupportedFamily
    from model.opening import ModelOptions, open_model

    check_weights_file(folder)
    check_config_values(folder)
    try:
        return open_model(folder, task, ModelOptions(attention_backend=attention_backend)).model
    except UnsupportedFamily as err:
        raise ExampleError(f"{folder / 'config.json'}: {err}") from None
    except (OSError, ValueError, RuntimeError) as err:
        reason = first_line(err).removeprefix(f"{folder}: ")  # our own checks name the folder already
        raise ExampleError(f"{folder}: the model cannot be loaded ({reason[:400]})") from None


def hands_token_types(folder: Path) -> bool:
    """Whether transformers' tokenizer of the folder returns token_type_ids (its
    model_input_names): where it does not, the model is given zeros, pairs included."""
    from transformers import AutoTokenizer

    try:
        return "token_type_ids" in AutoTokenizer.from_pretrained(folder).model_input_names
    except Exception:  # noqa: BLE001 - a tokenizer transformers cannot build: the template's own ids
        return True


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


def read_json_object(path: Path) -> dict:
    """A JSON object from `path`, or ExampleError naming the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExampleError(f"{path}: not readable JSON ({first_line(err)[:120]})") from None
    if not isinstance(value, dict):
        raise ExampleError(f"{path}: expected a JSON object")
    return value


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
        raise ExampleError(
            f"{config_path}: key 'architectures' is {architectures}; predict runs a "
            "*ForSequenceClassification, *ForTokenClassification or *ForQuestionAnswering folder "
            "(for embeddings of a bare encoder use finetune.embed --pooling)"
        )
    return task


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


def describe_hub_folder(folder: Path) -> dict:
    """What a folder without finetune.json says about running it, from config.json and the
    tokenizer's files, with transformers' pipelines' defaults for the rest."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ExampleError(
            f"{folder}: no config.json and no {FINETUNE_INFO}; expected a folder written by "
            "finetune.train or by transformers' save_pretrained"
        )
    config = read_json_object(config_path)
    task = task_of_architectures(config, config_path)
    from model.families import usable_positions
    from model.opening import supported_model_types

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


def folder_tokenizer(folder: Path):
    """The folder's tokenizer.json as a `tokenizers.Tokenizer` (a folder with only a
    sentencepiece model or BPE files: the one transformers converts them to), padding and
    truncation off (the callers truncate, and count what they cut)."""
    from tokenizers import Tokenizer

    try:
        if (folder / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder, use_fast=True).backend_tokenizer
            tokenizer = Tokenizer.from_str(tokenizer.to_str())
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises its own Exception
        raise ExampleError(f"{folder}: its tokenizer cannot be read ({first_line(err)[:120]})") from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


# Sizes in config.json that build the model's tensors (BERT's, DistilBERT's and GPT-2's names): each,
# where present, must be an integer >= 1; transformers would fail deep inside (or build an
# empty model) on a string, null, 0 or a negative number.
SIZE_KEYS = (
    "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
    "max_position_embeddings", "type_vocab_size", "dim", "n_layers", "n_heads", "hidden_dim",
    "n_positions", "n_embd", "n_layer", "n_head",
)  # fmt: skip


def check_config_values(folder: Path) -> None:
    """config.json's sizes, checked before transformers reads them: one line naming the key."""
    config_path = folder / "config.json"
    config = read_json_object(config_path)
    for key in SIZE_KEYS:
        if key not in config:
            continue
        value = config[key]
        least = 0 if key == "type_vocab_size" else 1  # DeBERTa-v2 has no token types: 0
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ExampleError(f"{config_path}: key {key!r} must be an integer >= {least}, got {value!r}")
    for size, heads in (("hidden_size", "num_attention_heads"), ("dim", "n_heads")):
        if size in config and heads in config and config[size] % config[heads]:
            raise ExampleError(
                f"{config_path}: key {size!r} ({config[size]}) must be a multiple of {heads!r} ({config[heads]})"
            )


def check_vocabulary_fits(folder: Path, tokenizer, model) -> None:
    """A tokenizer whose ids reach past the loaded model's embedding table (its config's
    vocab_size) would index out of range on the first text holding such a token: refused in
    one line."""
    vocab_size = getattr(model.config, "vocab_size", None)
    tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    if isinstance(vocab_size, int) and tokens > vocab_size:
        raise ExampleError(
            f"{folder / 'config.json'}: key 'vocab_size' is {vocab_size}, but the folder's tokenizer has {tokens} "
            "tokens: their ids would reach past the model's embedding table"
        )


def check_weights_file(folder: Path) -> None:
    """Weights the loader reads without unpickling: model.safetensors (or its sharded index).
    A folder with only a pickle (pytorch_model.bin) is refused in one line: transformers
    refuses to load it without code execution, and so do we."""
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
    if pickles:
        raise ExampleError(
            f"{folder}: weights only in {pickles[0]} (a pickle, which is never loaded here); save them "
            "as model.safetensors (save_pretrained(..., safe_serialization=True))"
        )
    raise ExampleError(f"{folder}: no model.safetensors; expected the weights transformers saves")
