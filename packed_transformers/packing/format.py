"""The packed format of ARCHITECTURE.md section 3, in numpy: field specs and row assembly.

One row per pack, static shapes: S tokens, K sequence slots, M masked-token slots.
`pack_sequences` lays sequences back to back from position 0 and fills every field.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packed_transformers.common.constants import BERT_VOCAB_SIZE

FORMAT_NAME = "packed-bert"
FORMAT_VERSION = 1

# field -> (shape in terms of S, K, M; dtype). input_ids / masked_lm_ids widen to int32
# when the vocabulary does not fit uint16.
PACKED_FIELDS = {
    "input_ids": ("S", np.uint16),
    "segment_ids": ("S", np.uint8),
    "position_ids": ("S", np.uint16),
    "sequence_ids": ("S", np.uint8),
    "masked_lm_positions": ("M", np.uint16),
    "masked_lm_ids": ("M", np.uint16),
    "masked_lm_weights": ("M", np.uint8),
    "next_sentence_positions": ("K", np.uint16),
    "next_sentence_labels": ("K", np.uint8),
    "next_sentence_weights": ("K", np.uint8),
    "source_index": ("K", np.int64),
}


@dataclass
class Sequence:
    """One unpacked sequence: real tokens only (no padding)."""

    input_ids: np.ndarray  # [L]
    segment_ids: np.ndarray  # [L]
    masked_lm_positions: np.ndarray  # [P] positions inside the sequence
    masked_lm_ids: np.ndarray  # [P]
    next_sentence_label: int
    source_index: int = -1


def field_dtypes(vocab_size: int) -> dict:
    wide = vocab_size > np.iinfo(np.uint16).max + 1
    dtypes = {name: dtype for name, (_, dtype) in PACKED_FIELDS.items()}
    if wide:
        dtypes["input_ids"] = dtypes["masked_lm_ids"] = np.int32
    return dtypes


def empty_packs(packs: int, s: int, k: int, m: int, vocab_size: int = BERT_VOCAB_SIZE) -> dict:
    sizes = {"S": s, "K": k, "M": m}
    dtypes = field_dtypes(vocab_size)
    out = {
        name: np.zeros((packs, sizes[dim]), dtype=dtypes[name]) for name, (dim, _) in PACKED_FIELDS.items()
    }
    out["source_index"][:] = -1
    return out


def pack_sequences(
    packs: list[list[Sequence]], s: int, k: int, m: int, vocab_size: int = BERT_VOCAB_SIZE
) -> dict:
    """Assemble packed rows: packs[r] lists the sequences of row r (at most k of them, at
    most s tokens, at most m masked tokens in all). Raises ValueError if one does not fit."""
    out = empty_packs(len(packs), s, k, m, vocab_size)
    for row, sequences in enumerate(packs):
        if len(sequences) > k:
            raise ValueError(f"pack {row} holds {len(sequences)} sequences, more than K={k}")
        offset, slot = 0, 0
        for j, seq in enumerate(sequences, start=1):
            length = len(seq.input_ids)
            if offset + length > s:
                raise ValueError(f"pack {row} needs more than S={s} tokens")
            span = slice(offset, offset + length)
            out["input_ids"][row, span] = seq.input_ids
            out["segment_ids"][row, span] = seq.segment_ids
            out["position_ids"][row, span] = np.arange(length)
            out["sequence_ids"][row, span] = j
            predictions = len(seq.masked_lm_positions)
            if slot + predictions > m:
                raise ValueError(f"pack {row} has more than M={m} masked tokens")
            out["masked_lm_positions"][row, slot : slot + predictions] = (
                np.asarray(seq.masked_lm_positions) + offset
            )
            out["masked_lm_ids"][row, slot : slot + predictions] = seq.masked_lm_ids
            out["masked_lm_weights"][row, slot : slot + predictions] = j
            out["next_sentence_positions"][row, j - 1] = offset
            out["next_sentence_labels"][row, j - 1] = seq.next_sentence_label
            out["next_sentence_weights"][row, j - 1] = 1
            out["source_index"][row, j - 1] = seq.source_index
            offset += length
            slot += predictions
    return out
