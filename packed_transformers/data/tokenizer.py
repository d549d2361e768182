"""The BERT WordPiece tokenizer from a vocab.txt, shared by pretraining-data creation and
fine-tuning (the `tokenizers` library, uncased)."""

from __future__ import annotations

from pathlib import Path


class DataInputError(ValueError):
    """Bad user input for data creation or tokenization; CLIs print it and exit with 2."""


def load_tokenizer(vocab_file: Path):
    from tokenizers import BertWordPieceTokenizer

    if not vocab_file.is_file():
        raise DataInputError(f"{vocab_file}: vocabulary file not found")
    vocab = {}
    for i, line in enumerate(vocab_file.read_text(encoding="utf-8").splitlines()):
        vocab.setdefault(line.strip(), i)
    for token in ("[CLS]", "[SEP]", "[MASK]", "[UNK]"):
        if token not in vocab:
            raise DataInputError(
                f"--vocab {vocab_file}: the token {token} is missing (not a BERT vocabulary)"
            )
    # vocab= (a dict), not vocab_file=: BertTokenizerFast(vocab_file=...) ignores the file under transformers 5.x.
    return BertWordPieceTokenizer(vocab=vocab, lowercase=True), vocab
