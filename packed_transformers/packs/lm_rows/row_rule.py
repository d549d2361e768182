"""The causal-LM row format as one pure decision: `first_malformed_row` returns the first row
of a block that breaks it, as a typed `RowFault`, or None. No I/O; numpy only.

The rules (packs.lm_rows.layouts.Rows; `write_rows` only writes rows that keep them):
  * input_ids in 0..vocab_size-1;
  * sequence_ids in 0..K; a row's real tokens (sequence id > 0) are a prefix of it, at least
    one, and padding after them (no hole inside a document);
  * segments are contiguous runs numbered 1, 2, ... from the row's start (a segment never
    comes back after another);
  * positions count 0, 1, 2, ... inside each segment;
  * document_ids in 0..documents-1 on real tokens, -1 on padding; document_offsets >= 0, and
    inside a segment each token is the next of the same document (offset + 1), except that
    the concatenated layout's single segment may start a new document at offset 0.
Vectorised over the block: a block of [n, S] costs a few passes of n x S compares.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RowFault:
    """The first row of a block that breaks the format, and the rule it breaks."""

    row: int  # index in the block
    rule: str  # the rule, as a user reads it


def _first(bad: np.ndarray) -> int | None:
    """The first row with any True in bad [n, S] (or bad [n]), else None."""
    rows = bad if bad.ndim == 1 else bad.any(axis=1)
    hit = np.flatnonzero(rows)
    return int(hit[0]) if hit.size else None


def first_malformed_row(
    fields: dict[str, np.ndarray], depth: int, vocab_size: int, documents: int | None, layout: str
) -> RowFault | None:
    """fields: input_ids, sequence_ids, position_ids, document_ids, document_offsets, each
    [n, S] integers (any width). depth: K; documents: how many documents the ids may name
    (None: unchecked); layout: "documents" or "concatenated"."""
    ids = fields["input_ids"].astype(np.int64)
    seq = fields["sequence_ids"].astype(np.int64)
    pos = fields["position_ids"].astype(np.int64)
    doc = fields["document_ids"].astype(np.int64)
    off = fields["document_offsets"].astype(np.int64)
    real = seq > 0
    checks = (
        (lambda: (ids < 0) | (ids >= vocab_size), f"a token id outside 0..{vocab_size - 1} (vocab_size)"),
        (lambda: (seq < 0) | (seq > depth), f"a sequence id outside 0..{depth} (K)"),
        (lambda: ~real[:, 0], "no real token at its start (an empty row, or padding first)"),
        (lambda: real[:, 1:] & ~real[:, :-1], "a real token after padding (a hole inside the row)"),
        (lambda: real[:, :1] & (seq[:, :1] != 1), "its first segment is not numbered 1"),
        (
            lambda: real[:, 1:] & ((seq[:, 1:] - seq[:, :-1]) != 0) & ((seq[:, 1:] - seq[:, :-1]) != 1),
            "segments that are not contiguous runs numbered 1, 2, ...",
        ),
    )
    for bad, rule in checks:
        row = _first(bad())
        if row is not None:
            return RowFault(row, rule)
    same = real[:, 1:] & (seq[:, 1:] == seq[:, :-1])  # token t+1 continues token t's segment
    starts = np.concatenate([real[:, :1], real[:, 1:] & ~same], axis=1)
    next_in_document = (doc[:, 1:] == doc[:, :-1]) & (off[:, 1:] == off[:, :-1] + 1)
    if layout == "concatenated":
        next_in_document |= (doc[:, 1:] != doc[:, :-1]) & (off[:, 1:] == 0)
    later = (
        (lambda: starts & (pos != 0), "a segment whose positions do not start at 0"),
        (lambda: same & (pos[:, 1:] != pos[:, :-1] + 1), "positions that jump inside a segment"),
        (lambda: ~real & (doc != -1), "a padding token with a document id (expected -1)"),
        (
            lambda: (
                real & ((doc < 0) | (doc >= (documents if documents is not None else np.iinfo(np.int64).max)))
            ),
            f"a document id outside 0..{documents - 1 if documents else 'N'} (documents_in)",
        ),
        (lambda: real & (off < 0), "a negative document offset"),
        (lambda: same & ~next_in_document, "a token that is not its document's next inside a segment"),
    )
    for bad, rule in later:
        row = _first(bad())
        if row is not None:
            return RowFault(row, rule)
    return None
