"""Hub-style folders for the tests: a tiny BERT classifier as transformers saves it, any family
saved with its tokenizer, BBC sentences, and commands run as modules with their one-line errors.

Shared by several test modules (no test module imports another)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
)

from packed_transformers.data.assets import corpus_glob
from packed_transformers.data.embedding_texts import bbc_articles, texts_of

from .conftest import REPO

SENTENCES = texts_of(bbc_articles(corpus_glob())[:6], "sentences")


TEXTS = [s for s in SENTENCES if 3 < len(s.split()) < 40][:24] + [
    "Ada Lovelace met Charles Babbage in London."
]


def save_hub_folder(folder: Path, model, tokenizer) -> Path:
    """model + tokenizer as save_pretrained writes them, then vocab.txt removed: the folder's
    tokenizer is tokenizer.json alone."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "vocab.txt").unlink(missing_ok=True)  # transformers 5 writes tokenizer.json alone
    assert not (folder / "finetune.json").exists() and (folder / "tokenizer.json").is_file()
    return folder


def tiny_config(tokenizer, **extra) -> BertConfig:
    return BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128, **extra,
    )  # fmt: skip


def tiny_hub_classifier(folder):
    """A 2-label tiny BERT classifier folder as transformers saves it (tokenizer.json only), its
    lowercase vocabulary learned once from TEXTS (tests/fixtures/tokenizers/wordpiece-uncased-400.txt)."""
    from .fixture_tokenizers import bert_vocabulary
    from .folder_helpers import save_hub_folder, tiny_config

    tokenizer = BertTokenizerFast(vocab=bert_vocabulary("wordpiece-uncased-400.txt"), model_max_length=64)
    torch.manual_seed(0)
    return save_hub_folder(
        folder, BertForSequenceClassification(tiny_config(tokenizer, num_labels=2)), tokenizer
    )


# ----- 6, 9 and the empty-text rule: one line each, or read once ------------------------------------
def run_module(module, *argv, timeout=180):
    """`python -m packed_transformers.MODULE ARGV` (MODULE named inside the package)."""
    module = module if module.startswith("packed_transformers.") else f"packed_transformers.{module}"
    return subprocess.run([sys.executable, "-m", module, *map(str, argv)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def one_line_error(done) -> str:
    assert done.returncode == 2, done.stderr
    lines = [
        line for line in done.stderr.strip().splitlines() if "it/s]" not in line and "text/s]" not in line
    ]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in done.stderr, done.stderr
    return lines[0]  # (a progress bar's lines aside)


def variant(folder, where, edit_config=None, drop_weights=()):
    """A copy of the classifier folder with config.json edited and/or weights removed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, where)
    if edit_config is not None:
        config = json.loads((where / "config.json").read_text())
        edit_config(config)
        (where / "config.json").write_text(json.dumps(config))
    if drop_weights:
        weights = load_file(where / "model.safetensors")
        kept = {k: v for k, v in weights.items() if not k.startswith(drop_weights)}
        save_file(kept, where / "model.safetensors", metadata={"format": "pt"})
    return where


def with_weight(folder, where, name, value):
    """A copy of `folder` whose weight `name` holds `value` at its first element."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, where)
    weights = load_file(where / "model.safetensors")
    weights[name].view(-1)[0] = value
    save_file(weights, where / "model.safetensors", metadata={"format": "pt"})
    return where


def roberta_over_bert(config):
    config.update(model_type="roberta", architectures=["RobertaForSequenceClassification"])


def input_file(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def embed_argv(model, source, output):
    return [
        "--model",
        str(model),
        "--input",
        str(source),
        "--output",
        str(output),
        "--pooling",
        "mean",
        "--quiet",
    ]
