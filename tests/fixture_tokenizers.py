"""The tests' tokenizers, read from the files tests/fixtures/learn_tokenizers.py stored once.

Nothing here trains: a tokenizer learned at test time was a different vocabulary in every
process (tokenizers issue 1794), so every test that used one saw other inputs on every run.
Each function builds a fresh object over the stored bytes; tests/house/test_fixtures_fixed.py
holds that two fresh processes get byte-identical tokenizer.json files and weights."""

from __future__ import annotations

from functools import cache
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "fixtures" / "tokenizers"


@cache
def _text(name: str) -> str:
    return (FOLDER / name).read_text(encoding="utf-8")


def stored_tokenizer(name: str):
    """A fresh `tokenizers.Tokenizer` from tests/fixtures/tokenizers/NAME (a tokenizer.json)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_text(name))


def encoder_tokenizer(kind: str, style: str):
    """The encoder families' tokenizer.json: kind wordpiece, bpe or unigram; style bert or roberta
    (its special tokens and template)."""
    return stored_tokenizer(f"{kind}-{style}.json")


def bert_vocabulary(name: str) -> dict[str, int]:
    """A stored BERT vocabulary (one token a line, in id order) as BertTokenizerFast's `vocab=`."""
    return {token: i for i, token in enumerate(_text(name).splitlines())}
