"""Opening a model folder with a head (classification, token classification, question
answering) or any folder's tokenizer, with the checks every opened folder passes: weights
that are safetensors, config.json's sizes, a tokenizer that fits the embedding table. What
finetune.train writes is in finetune/folder_writer.py; door.opener picks which opening a
folder gets.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from packed_transformers.common.choices import INFERENCE_ATTENTION_BACKEND
from packed_transformers.common.cli import first_line
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.data.tokenizer import load_tokenizer
from packed_transformers.door.folder_spec import describe_folder, read_json_object
from packed_transformers.door.loaded import LoadedModel
from packed_transformers.model.opening import ModelOptions


def load_finetuned(folder: Path, attention_backend: str | None = None) -> LoadedModel:
    """A model folder for predict and the server: a `finetune.train` output (finetune.json)
    or any folder transformers' `save_pretrained` wrote with a sequence-classification,
    token-classification or question-answering head (task from config.json's
    `architectures`, labels from `id2label`, multi-label from `problem_type`, tokenization
    by the folder's tokenizer as transformers builds it). attention_backend: BERT's kernel
    (default INFERENCE_ATTENTION_BACKEND, whatever the folder was trained with: every
    backend computes the same outputs). ExampleError (one line, naming the file and key) for
    a folder that cannot be run. Reached through door.opener.open_folder."""
    spec = describe_folder(folder)
    folder = spec.path
    # The tokenizer first, built once: whether it hands token_type_ids is the model's to know.
    opened_tokenizer = None if spec.tokenizer == "vocab.txt" else open_tokenizer(folder, spec.model_config)
    options = ModelOptions(
        attention_backend=attention_backend or INFERENCE_ATTENTION_BACKEND,
        token_types=None if opened_tokenizer is None else opened_tokenizer.token_types,
    )
    opened = open_packed_model(folder, spec.task, options, spec.model_config)
    model = opened.model
    # New text may be longer than anything seen in training: a finetune.train folder takes it
    # up to the model's positions; any other folder up to its tokenizer's model_max_length too.
    limit = opened.max_tokens if spec.length_cap is None else min(opened.max_tokens, spec.length_cap)
    if spec.tokenizer == "vocab.txt":
        # finetune.train's own folders: the WordPiece it trained with, exactly
        tokenizer, vocab = load_tokenizer(folder / "vocab.txt")
        check_vocabulary_fits(folder, tokenizer, model)
        return LoadedModel(spec, model, tokenizer, vocab, max_input_length=limit)
    # Any other folder: the tokenizer transformers builds from whatever files it has (a
    # vocab.txt-only folder keeps tokenizer_config.json's do_lower_case, cased or not).
    check_vocabulary_fits(folder, opened_tokenizer.tokenizer, model)
    return LoadedModel(
        spec, model, opened_tokenizer.tokenizer, None, opened_tokenizer.token_types, max_input_length=limit,
        transformers_tokenizer=opened_tokenizer.transformers_tokenizer,
    )  # fmt: skip


def open_packed_model(folder: Path, task: str, options: ModelOptions, config, label: str | None = None):
    """model.opening.open_model for every door, with the one wrap of its failures: the weights
    file checked first (safetensors, never a pickle), config.json's sizes, then one
    ExampleError line for a model_type the table does not hold, weights that are not finite,
    or a folder that cannot be loaded. config: config.json as read (read here if None);
    label: how the line names the folder (default: the folder; fine-tuning names its key,
    "model.init_checkpoint ..."). -> model.opening.OpenedModel."""
    from packed_transformers.model.families import UnsupportedFamily
    from packed_transformers.model.opening import NonFiniteWeights, open_model

    check_weights_file(folder)
    config = config or read_json_object(folder / "config.json")  # one line naming the file if unreadable
    check_config_values(folder, config)
    try:
        return open_model(folder, task, options, config)
    except UnsupportedFamily as err:
        raise ExampleError(f"{label or folder / 'config.json'}: {err}") from None
    except NonFiniteWeights as err:  # names the weights file and the weight itself
        raise ExampleError(str(err)) from None
    except ExampleError:
        raise
    except (OSError, ValueError, RuntimeError) as err:
        reason = first_line(err).removeprefix(f"{folder}: ")  # our own checks name the folder already
        raise ExampleError(f"{label or folder}: the model cannot be loaded ({reason[:400]})") from None


# The files a tokenizer is built from (transformers' names; a chat template in its own file too).
TOKENIZER_FILE_PATTERNS = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.txt",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "*.model",
)  # fmt: skip


def tokenizer_files(folder: Path) -> list[Path]:
    """The folder's files a tokenizer is built from, sorted (a tokenizer changed in place
    changes one of them)."""
    return sorted({path for pattern in TOKENIZER_FILE_PATTERNS for path in Path(folder).glob(pattern)})


@dataclass(frozen=True)
class FolderTokenizer:
    """A folder's tokenizer as transformers builds it: `tokenizer`, a `tokenizers.Tokenizer`
    (padding and truncation off: the callers cut, and count what they cut); token_types:
    whether transformers' tokenizer returns token_type_ids (where not, the model is given
    zeros, pairs included)."""

    tokenizer: object
    token_types: bool
    eos_id: int | None = None  # the end-of-sequence token's id, where the folder names one
    transformers_tokenizer: object = None  # the one transformers built (None where it could not)
    vocab: dict | None = None  # finetune.train's WordPiece over a vocab.txt: that vocabulary


def open_tokenizer(folder: Path, config: Mapping | None = None) -> FolderTokenizer:
    """The folder's tokenizer exactly as `AutoTokenizer.from_pretrained(folder)` tokenizes:
    its backend tokenizer. transformers 5.x tokenizer classes may rebuild the normalizer,
    pre-tokenizer and post-processor from the class rather than take tokenizer.json's (a
    Qwen2 folder gets NFC and Qwen2's split pattern whatever its file says; Llama's class sets
    the BOS template from add_bos_token), so tokenizer.json read alone can give other ids.
    config: config.json as read (None: transformers reads it if it needs the class). Where
    transformers cannot build a tokenizer (no class it knows), the folder's tokenizer.json
    is the tokenizer: nothing else defines one. ExampleError (one line) where neither reads."""
    from tokenizers import Tokenizer

    try:
        hf = auto_tokenizer(folder, config)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a class it cannot build
        if not (folder / "tokenizer.json").is_file():
            raise ExampleError(f"{folder}: its tokenizer cannot be read ({first_line(err)[:120]})") from None
        hf = None
    try:
        if hf is not None:
            tokenizer = Tokenizer.from_str(hf.backend_tokenizer.to_str())  # a copy: settings of our own
        else:
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises its own Exception
        raise ExampleError(f"{folder}: its tokenizer cannot be read ({first_line(err)[:120]})") from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    token_types = True if hf is None else "token_type_ids" in hf.model_input_names
    eos_id = getattr(hf, "eos_token_id", None) if hf is not None else None
    return FolderTokenizer(tokenizer, token_types, eos_id if isinstance(eos_id, int) else None, hf)


def auto_tokenizer(folder: Path, config: Mapping | None):
    """transformers' fast tokenizer of the folder, given config.json as read (so that the file
    is not read again where tokenizer_config.json names no class)."""
    from transformers import AutoConfig, AutoTokenizer

    given = {}
    settings = dict(config or {})
    family = settings.pop("model_type", None)
    if isinstance(family, str):
        try:
            given["config"] = AutoConfig.for_model(family, **settings)
        except (ValueError, TypeError, KeyError):
            pass  # transformers reads config.json itself, and says what is wrong with it
    return AutoTokenizer.from_pretrained(folder, use_fast=True, trust_remote_code=False, **given)


# Sizes in config.json that build the model's tensors (BERT's, DistilBERT's and GPT-2's names): each,
# where present, must be an integer >= 1; transformers would fail deep inside (or build an
# empty model) on a string, null, 0 or a negative number.
SIZE_KEYS = (
    "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
    "max_position_embeddings", "type_vocab_size", "dim", "n_layers", "n_heads", "hidden_dim",
    "n_positions", "n_embd", "n_layer", "n_head",
)  # fmt: skip


def check_config_values(folder: Path, config=None) -> None:
    """config.json's sizes (`config`: the file as read; None: read here), checked before
    transformers reads them: one line naming the key."""
    config_path = folder / "config.json"
    config = config or read_json_object(config_path)  # {}: a folder without one, which this names
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
    check_vocabulary_size(
        folder, getattr(model.config, "vocab_size", None), tokenizer.get_vocab_size(with_added_tokens=True)
    )


def check_vocabulary_size(folder: Path, vocab_size, tokens: int) -> None:
    """check_vocabulary_fits on config.json's vocab_size as read (before any model is built)."""
    if isinstance(vocab_size, int) and tokens > vocab_size:
        raise ExampleError(
            f"{folder / 'config.json'}: key 'vocab_size' is {vocab_size}, but the folder's tokenizer has {tokens} "
            "tokens: their ids would reach past the model's embedding table"
        )


def check_positions(checkpoint: Path, length: int) -> dict:
    """Fine-tuning's data.max_sequence_length (`length`) must fit the checkpoint's position
    embeddings: checked from its config.json before any text is read, tokenized or packed.
    -> config.json as read, which the job hands on (the tokenizer, the door): a run reads the
    file once. ExampleError otherwise."""
    config_file = checkpoint / "config.json"
    if not checkpoint.is_dir():
        raise ExampleError(f"model.init_checkpoint {checkpoint}: no such folder")
    if not config_file.is_file():
        raise ExampleError(
            f"model.init_checkpoint {checkpoint}: no config.json (not a Hugging Face model folder)"
        )
    try:
        described = json.loads(config_file.read_text())
        positions = described.get("max_position_embeddings", described.get("n_positions"))
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise ExampleError(f"{config_file}: not a readable config ({first_line(err)[:200]})") from None
    from packed_transformers.model.families import usable_positions

    if isinstance(positions, int):
        positions = usable_positions(described.get("model_type"), positions, described.get("pad_token_id"))
    if isinstance(positions, int) and length > positions:
        raise ExampleError(
            f"data.max_sequence_length {length}: the checkpoint {checkpoint} has {positions} positions; "
            f"give at most {positions}"
        )
    return described


def check_vocab_file(checkpoint: Path, vocab_file: Path, checkpoint_config: dict | None = None) -> None:
    """Fine-tuning's data.vocab_file must produce the ids the checkpoint's embeddings were trained
    on: the checkpoint's own vocab.txt where it has one, and no more tokens than its vocab_size.
    checkpoint_config: its config.json as read (None: read here). ExampleError otherwise."""
    tokens = vocab_file.read_text(encoding="utf-8").splitlines()
    own = checkpoint / "vocab.txt"
    if own.is_file() and own.resolve() != vocab_file.resolve():
        theirs = own.read_text(encoding="utf-8").splitlines()
        if theirs != tokens:
            row = next(
                (i for i, (a, b) in enumerate(zip(tokens, theirs)) if a != b), min(len(tokens), len(theirs))
            )
            raise ExampleError(
                f"data.vocab_file {vocab_file} differs from the checkpoint's {own} at line {row + 1} "
                f"({len(tokens)} vs {len(theirs)} tokens): the checkpoint's embeddings expect its own "
                f"vocabulary; leave data.vocab_file null to use it"
            )
    if checkpoint_config is None:
        checkpoint_config = read_json_object(checkpoint / "config.json")
    model_vocab = checkpoint_config.get("vocab_size")
    if model_vocab is not None and len(tokens) > model_vocab:
        raise ExampleError(
            f"data.vocab_file {vocab_file} has {len(tokens)} tokens but the checkpoint {checkpoint} "
            f"embeds vocab_size={model_vocab}: token ids would fall outside its embedding table"
        )


def check_weights_file(folder: Path) -> None:
    """Weights the loader reads without unpickling: model.safetensors (or its sharded index).
    A folder with only a pickle (pytorch_model.bin) is refused in one line: transformers
    refuses to load it without code execution, and so do we."""
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return
    from packed_transformers.common.files import not_a_file

    for name in ("model.safetensors", "model.safetensors.index.json"):
        what = not_a_file(folder / name)  # a FIFO or device is there, not absent
        if what is not None:
            raise ExampleError(
                f"{folder / name}: is {what}, not a weights file; expected the file transformers saves"
            )
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
    if pickles:
        raise ExampleError(
            f"{folder}: weights only in {pickles[0]} (a pickle, which is never loaded here); save them "
            "as model.safetensors (save_pretrained(..., safe_serialization=True))"
        )
    raise ExampleError(f"{folder}: no model.safetensors; expected the weights transformers saves")
