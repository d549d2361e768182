"""One door from a model folder to its packed model: (model_type, task) -> the builder.

    opened = open_model(folder, "classification", ModelOptions(new_head=True, config={"num_labels": 3}))
    opened.model         # a torch module taking packed rows
    opened.max_tokens    # tokens per sequence its position table holds

Which stack runs a folder is decided here and nowhere else: BERT on this project's own
packed BERT heads (model/bert_heads.py, ...: every attention backend, IPU-ready),
every other encoder family on transformers' own modules with packed attention
(model/families.py `PackedFamilyModel`). finetune/ and serving/ ask for a task; they never
compare a `model_type`. A type the table does not hold is one UnsupportedFamily line naming
the supported list.

Every builder loads strictly (model.hf_checkpoint.load_checked, load_weights): `new_head=True`
where fine-tuning (or pooling for embeddings) needs no head from the file. Opened for
inference, BERT's classifier and embedding models are plain torch modules
(model/inference_head.py): start-up without transformers' modeling code.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from packed_transformers.common.choices import INFERENCE_ATTENTION_BACKEND
from packed_transformers.model.embedding import check_pooling
from packed_transformers.model.families import FAMILIES, UnsupportedFamily, max_tokens, use_packed_attention

TASKS = ("classification", "token_classification", "question_answering", "embedding", "causal_lm")


@dataclass(frozen=True)
class ModelOptions:
    """What a caller sets when opening a folder; None keeps the folder's own value.

    new_head: a head absent from the file may be initialised (the start of fine-tuning:
        the model is trainable, a transformers PreTrainedModel); False refuses it
        (inference: BERT's heads are then built as plain torch modules, model.inference_head,
        without importing transformers' modeling code).
    attention_backend: dense | sdpa | flex | varlen (BERT's own stack; the other families
        run transformers' attention interface with packed masks).
    dropout: {"hidden" | "attention" | "classifier": probability or None}: each key given
        is set (None too: the classifier then follows the hidden dropout, as transformers
        reads it), on whichever of the family's config keys name it; absent keys keep the
        folder's values.
    pooling: embedding pooling: a mode or modes (model.embedding.POOLING_MODES; default mean).
    config: config settings of the task head (num_labels, problem_type, id2label, label2id).
    token_types: whether the folder's tokenizer hands the model token_type_ids, where the
        caller has built that tokenizer (the door: built once per run); None: the family's
        builder asks transformers' tokenizer of the folder itself.
    """

    new_head: bool = False
    attention_backend: str | None = None
    dropout: Mapping[str, float | None] = field(default_factory=dict)
    pooling: str | tuple[str, ...] | list[str] | None = None
    config: Mapping = field(default_factory=dict)
    token_types: bool | None = None


@dataclass(frozen=True)
class OpenedModel:
    """model: the packed torch module; max_tokens: tokens per sequence it takes."""

    model: torch.nn.Module
    max_tokens: int


# task -> (module, class) of this project's BERT head. Imported when a folder of that task
# is opened: the trainable heads are transformers PreTrainedModels (model/packed_head.py),
# whose import costs seconds; the embedding model is a plain torch module.
BERT_HEADS: dict[str, tuple[str, str]] = {
    "classification": ("packed_transformers.model.bert_heads", "PackedBertForSequenceClassification"),
    "token_classification": ("packed_transformers.model.bert_heads", "PackedBertForTokenClassification"),
    "question_answering": ("packed_transformers.model.bert_heads", "PackedBertForQuestionAnswering"),
    "embedding": ("packed_transformers.model.embedding", "PackedBertForEmbedding"),
}
# Opened for inference (no new head): the same layers as a plain torch module
# (model/inference_head.py), loaded without transformers' modeling code.
BERT_INFERENCE_HEADS: dict[str, tuple[str, str]] = {
    "classification": ("packed_transformers.model.inference_head", "SequenceClassifierForInference"),
    "token_classification": ("packed_transformers.model.inference_head", "TokenClassifierForInference"),
    "question_answering": ("packed_transformers.model.inference_head", "QuestionAnsweringForInference"),
}


def bert_head(task: str, new_head: bool = False) -> type:
    module, name = BERT_HEADS[task] if new_head else BERT_INFERENCE_HEADS.get(task, BERT_HEADS[task])
    return getattr(importlib.import_module(module), name)


# ModelOptions.dropout's names -> BertConfig's keys
BERT_DROPOUT_KEYS = {
    "hidden": "hidden_dropout_prob",
    "attention": "attention_probs_dropout_prob",
    "classifier": "classifier_dropout",
}


def open_bert(folder: Path, task: str, options: ModelOptions, config: Mapping) -> OpenedModel:
    """This project's packed BERT head for `task` (dropouts as BertConfig names them)."""
    settings = dict(options.config)
    if options.attention_backend is not None:
        settings["attention_backend"] = options.attention_backend
    settings.update({BERT_DROPOUT_KEYS[what]: value for what, value in options.dropout.items()})
    if task == "embedding":  # pooled by this project: the encoder's own pooler is not used
        settings.update(pooling=list(check_pooling(options.pooling or "mean")), normalize=False)
    model = bert_head(task, options.new_head).from_pretrained(
        folder, new_head=options.new_head, config_dict=config, **settings
    )
    return OpenedModel(model, model.config.max_position_embeddings)


def open_family(folder: Path, task: str, options: ModelOptions, config: Mapping) -> OpenedModel:
    """transformers' own modules of the family, attention packed (model/families.py)."""
    from packed_transformers.model.family_model import PackedFamilyModel

    model = PackedFamilyModel.from_pretrained(
        folder, task, check_pooling(options.pooling or "mean"), dropout=dict(options.dropout) or None, new_head=options.new_head,
        config_dict=config, token_types=options.token_types, **dict(options.config),
    )  # fmt: skip
    return OpenedModel(model, model.max_tokens)


# model_type -> builder: BERT on its own stack, every other encoder family on its own modules.
OPENERS: dict[str, Callable[[Path, str, ModelOptions, Mapping], OpenedModel]] = {
    **{model_type: open_family for model_type in FAMILIES},
    "bert": open_bert,
}


def supported_model_types() -> list[str]:
    return sorted(OPENERS)


def read_model_config(folder: Path) -> dict:
    """config.json as a dict ({} where unreadable or not an object: the loader then says why)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def model_type_of(folder: Path) -> str | None:
    """config.json's model_type (None where unreadable: the loader then says why)."""
    return read_model_config(folder).get("model_type")


def opener_for(model_type: str | None) -> Callable[[Path, str, ModelOptions, Mapping], OpenedModel]:
    if model_type not in OPENERS:
        raise UnsupportedFamily(
            f"model_type {model_type!r} is not a packed model family (encoder or decoder); supported: {', '.join(supported_model_types())}"
        )
    return OPENERS[model_type]


def open_model(
    folder, task: str, options: ModelOptions | None = None, config: Mapping | None = None
) -> OpenedModel:
    """The packed model of `folder` for `task` (TASKS). config: the folder's config.json as
    the caller read it (FolderSpec.model_config; None: read here), so that the file is read
    once on the way in. UnsupportedFamily for a model_type the table does not hold;
    ValueError / OSError / RuntimeError (one line naming the folder) for a folder that
    cannot be loaded."""
    if task not in TASKS:
        raise ValueError(f"task {task!r}: expected one of {', '.join(TASKS)}")
    folder = Path(folder)
    config = read_model_config(folder) if config is None else config
    model_type = config.get("model_type")
    opener = opener_for(model_type)
    if task == "causal_lm" and not (model_type in FAMILIES and FAMILIES[model_type].causal):
        raise UnsupportedFamily(
            f"model_type {model_type!r} is an encoder (it attends both ways): causal_lm trains a decoder; "
            f"decoder families: {', '.join(decoder_model_types())}"
        )
    opened = opener(folder, task, options or ModelOptions(), config)
    check_finite_weights(folder, opened.model)
    return opened


class NonFiniteWeights(ValueError):
    """A folder whose weights hold NaN or an infinity (a diverged fp16 fine-tune saves such
    a folder): every output would be NaN, so it is never run."""


def first_non_finite(model: torch.nn.Module) -> tuple[str, str] | None:
    """(name, "NaN" | "inf") of the first floating weight or buffer of `model`, in its
    state-dict order, that holds a non-finite value; None when all are finite. One pass
    over the weights (~50 ms per 100M parameters on a CPU core), with no copy kept."""
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point():
            continue
        if not bool(torch.isfinite(tensor).all()):
            return name, ("NaN" if bool(torch.isnan(tensor).any()) else "inf")
    return None


def check_finite_weights(folder: Path, model: torch.nn.Module) -> None:
    """NonFiniteWeights naming the weights file and the first non-finite weight."""
    found = first_non_finite(model)
    if found is not None:
        name, what = found
        raise NonFiniteWeights(
            f"{folder / weights_file_name(folder)}: weight {name} holds {what}; weights that are not finite "
            "give NaN for every input (a diverged run saved them?) and are never run"
        )


def weights_file_name(folder: Path) -> str:
    """model.safetensors, or its shard index where the weights are sharded."""
    index = "model.safetensors.index.json"
    return (
        index
        if (Path(folder) / index).is_file() and not (Path(folder) / "model.safetensors").is_file()
        else "model.safetensors"
    )


def decoder_model_types() -> list[str]:
    return sorted(model_type for model_type, family in FAMILIES.items() if family.causal)


def qa_fine_tuning_refusal(folder) -> str | None:
    """Why `finetune.train` cannot fine-tune question answering from `folder`, or None: its QA
    task (finetune.qa_task: WordPiece windows, this project's packed QA head) runs on BERT's
    own stack; the other families' QA folders run in predict and the server."""
    model_type = model_type_of(Path(folder))
    if OPENERS.get(model_type) is open_bert:
        return None
    return (
        f"question answering fine-tunes BERT checkpoints here; a {model_type!r} checkpoint fine-tunes for "
        "classification, and its QA folders run in predict and the server"
    )


def packed_from_loaded(hf_encoder, pooling, token_types: bool = False) -> torch.nn.Module:
    """A packed embedding model over an already loaded transformers encoder (a
    SentenceTransformer's `auto_model`), sharing its weights: no file read. BERT: this
    project's embedding model with the weights loaded by name; other families: the module
    itself, its attention routed through the packed function. token_types: whether the
    model's tokenizer hands token_type_ids (PackedFamilyModel.hand_token_types)."""
    if OPENERS.get(getattr(hf_encoder.config, "model_type", None)) is not open_bert:
        from packed_transformers.model.family_model import PackedFamilyModel

        use_packed_attention(hf_encoder)
        return PackedFamilyModel(hf_encoder, "embedding", tuple(pooling)).hand_token_types(token_types).eval()
    from packed_transformers.model.embedding import PackedBertForEmbedding

    config = type(hf_encoder.config).from_dict(hf_encoder.config.to_dict())
    config.embedding_pooling = list(pooling)
    config.embedding_normalize = False
    config.attention_backend = INFERENCE_ATTENTION_BACKEND
    model = PackedBertForEmbedding.build(config)
    state = {f"bert.{k}": v for k, v in hf_encoder.state_dict().items() if not k.startswith("pooler.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"weight names do not map: missing {missing}, unexpected {unexpected}")
    return model.to(next(hf_encoder.parameters()).device).eval()


__all__ = [
    "ModelOptions",
    "NonFiniteWeights",
    "OpenedModel",
    "TASKS",
    "max_tokens",
    "model_type_of",
    "open_model",
    "packed_from_loaded",
    "supported_model_types",
]
