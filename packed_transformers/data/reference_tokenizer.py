"""Text -> WordPiece ids exactly as the MLPerf reference generator tokenizes (uncased).

The reference (`create_pretraining_data.py` of mlcommons/training and google-research/bert)
runs a pure-Python BasicTokenizer then a greedy WordPiece with a 200-character word limit.
Two things follow that a stock `BertWordPieceTokenizer` gets wrong:

- Text is text: "[SEP]", "[MASK]", "[CLS]" written in a document are split at the brackets
  ("[", "sep", "]"), never turned into special tokens. So no special tokens are registered here.
- Words of 101..200 characters go through WordPiece; only longer ones become [UNK].

Speed: `tokenizers` (Rust) does the whole job for pure-ASCII lines, where its BertNormalizer and
BertPreTokenizer provably agree with the reference (the same control characters removed, the
same whitespace, the same ASCII punctuation, lower-casing and accent stripping are no-ops on
ASCII). For any other line the Unicode tables differ in corners (Rust's `is_other` also drops
private-use and unassigned characters; Rust counts U+000C as whitespace where Python's
BasicTokenizer drops it as a control character; the two Unicode versions differ), so those
lines take `basic_tokens` below, written to the reference's rules with Python's `unicodedata`,
and only the WordPiece step runs in Rust. Wikipedia text is mostly ASCII lines.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

from packed_transformers.data.tokenizer import DataInputError

MAX_WORD_CHARS = 200  # the reference WordpieceTokenizer's max_input_chars_per_word
REQUIRED_TOKENS = ("[CLS]", "[SEP]", "[MASK]", "[UNK]")


def read_vocab(vocab_file: Path) -> dict[str, int]:
    """vocab.txt -> {token: id}, id = line number. Lines are split on "\\n" only and stripped,
    as the reference's load_vocab does. A repeated token is refused: the reference would map it
    to its last line while drawing random words by position, which no sane vocabulary needs."""
    if not Path(vocab_file).is_file():
        raise DataInputError(f"{vocab_file}: vocabulary file not found")
    try:
        text = Path(vocab_file).read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataInputError(f"--vocab {vocab_file}: not UTF-8 ({err.reason} at byte {err.start})") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    vocab: dict[str, int] = {}
    for number, line in enumerate(lines):
        token = line.strip()
        if token in vocab:
            raise DataInputError(
                f"--vocab {vocab_file}: line {number + 1} repeats the token {token!r} of line {vocab[token] + 1}"
            )
        vocab[token] = number
    for token in REQUIRED_TOKENS:
        if token not in vocab:
            raise DataInputError(
                f"--vocab {vocab_file}: the token {token} is missing (not a BERT vocabulary)"
            )
    return vocab


# --- the reference BasicTokenizer's character classes (Python's unicodedata) ----------------


def _is_whitespace(ch: str) -> bool:
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def _is_control(ch: str) -> bool:
    return ch not in "\t\n\r" and unicodedata.category(ch) in ("Cc", "Cf")


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    # Every non-alphanumeric printable ASCII character counts, "^", "$" and "`" included,
    # though Unicode files them as symbols.
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def basic_tokens(text: str) -> list[str]:
    """The reference BasicTokenizer (do_lower_case=True): clean, space out CJK, split on
    whitespace, lower-case, strip accents (NFD, drop Mn), split off punctuation."""
    cleaned = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or _is_control(ch):
            continue
        if _is_whitespace(ch):
            cleaned.append(" ")
        elif _is_cjk(cp):
            cleaned.append(f" {ch} ")
        else:
            cleaned.append(ch)
    pieces: list[str] = []
    for word in "".join(cleaned).split():
        word = unicodedata.normalize("NFD", word.lower())
        word = "".join(ch for ch in word if unicodedata.category(ch) != "Mn")
        current = ""
        for ch in word:
            if _is_punctuation(ch):
                if current:
                    pieces.append(current)
                    current = ""
                pieces.append(ch)
            else:
                current += ch
        if current:
            pieces.append(current)
    # The reference re-splits the joined pieces on whitespace (lower-casing can create none,
    # but NFD can turn a space-like character into another one).
    return " ".join(pieces).split()


class ReferenceTokenizer:
    """`encode_lines(lines) -> [[id, ...], ...]`, equal to the reference FullTokenizer's
    `convert_tokens_to_ids(tokenize(line))` for every line."""

    def __init__(self, vocab: dict[str, int]):
        from tokenizers import Tokenizer
        from tokenizers.models import WordPiece
        from tokenizers.normalizers import BertNormalizer
        from tokenizers.pre_tokenizers import BertPreTokenizer

        self.vocab = vocab
        model_args = dict(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=MAX_WORD_CHARS)
        self._ascii = Tokenizer(WordPiece(**model_args))
        self._ascii.normalizer = BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=True, lowercase=True
        )
        self._ascii.pre_tokenizer = BertPreTokenizer()
        # Words already split by `basic_tokens`: WordPiece only, no normalizer, no pre-tokenizer.
        self._words = Tokenizer(WordPiece(**model_args))

    def encode_lines(self, lines: list[str]) -> list[list[int]]:
        out: list[list[int] | None] = [None] * len(lines)
        ascii_rows = [i for i, line in enumerate(lines) if line.isascii()]
        other_rows = [i for i, line in enumerate(lines) if not line.isascii()]
        if ascii_rows:
            encoded = self._ascii.encode_batch([lines[i] for i in ascii_rows], add_special_tokens=False)
            for i, e in zip(ascii_rows, encoded):
                out[i] = e.ids
        if other_rows:
            words = [basic_tokens(lines[i]) for i in other_rows]
            nonempty = [(i, w) for i, w in zip(other_rows, words) if w]
            for i, w in zip(other_rows, words):
                if not w:
                    out[i] = []
            if nonempty:
                encoded = self._words.encode_batch(
                    [w for _, w in nonempty], is_pretokenized=True, add_special_tokens=False
                )
                for (i, _), e in zip(nonempty, encoded):
                    out[i] = e.ids
        return out  # type: ignore[return-value]
