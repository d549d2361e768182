"""Fine-tuning's rows: a table of example indices [rows, K] -> the arrays the model reads,
and the model's per-slot outputs -> input order.

    table = pack_examples(lengths, 128, 6, "lpfhp", seed)    # packs/tokenized.py (K > 1)
    table = unpacked_table(n)                                  # one example per row (K = 1)
    rows = pack_rows(token_lists, table, max_tokens=128)       # dict of [rows, S] / [rows, K]
    logits = unpack_outputs(per_slot_logits, rows["example_index"], n)

Every example is in exactly one slot (checked both ways). Pure numpy: no torch here.
"""

from __future__ import annotations

import numpy as np

from packed_transformers.packs.errors import PackingBugError
from packed_transformers.packs.tokenized import check_table, pack_with_places

# Fields of a packed row for classification, [rows, S] or [rows, K]; what the model reads.
ROW_FIELDS = ("input_ids", "segment_ids", "position_ids", "sequence_ids", "cls_positions", "example_index")


def unpacked_table(n: int) -> np.ndarray:
    """The K = 1 table that puts example i alone in row i: [n, 1]."""
    return np.arange(n, dtype=np.int64)[:, None]


def pad_table(table: np.ndarray, multiple: int) -> np.ndarray:
    """Append empty packs (all -1) until the row count is a multiple of `multiple`: the last
    global batch keeps its static shape and no example is dropped."""
    extra = -len(table) % multiple
    return np.concatenate([table, np.full((extra, table.shape[1]), -1, dtype=table.dtype)])


def pack_rows(
    token_lists: list, table: np.ndarray, max_tokens: int, segment_lists: list | None = None
) -> dict[str, np.ndarray]:
    """The packed rows of `table`: a dict of int64 arrays.

    input_ids, segment_ids, position_ids, sequence_ids: [packs, max_tokens]; examples back to
        back from position 0, zero padded; position ids restart at 0 in every example and
        sequence_ids is j = 1..K for the j-th example of the pack, 0 for padding.
    cls_positions [packs, K]: the row position of each example's first token ([CLS]), 0 if absent.
    example_index [packs, K]: the table itself (-1 if absent).
    """
    packs, depth = table.shape
    out = {name: np.zeros((packs, max_tokens), dtype=np.int64) for name in ROW_FIELDS[:4]}
    out["cls_positions"] = np.zeros((packs, depth), dtype=np.int64)
    out["example_index"] = table.astype(np.int64, copy=True)
    for row, indices in enumerate(table.tolist()):
        start = 0
        for slot, index in enumerate(indices):
            if index < 0:
                continue
            tokens = token_lists[index]
            end = start + len(tokens)
            if end > max_tokens:
                raise PackingBugError(f"pack {row} overflows {max_tokens} tokens at example {index}")
            out["input_ids"][row, start:end] = tokens
            if segment_lists is not None:
                out["segment_ids"][row, start:end] = segment_lists[index]
            out["position_ids"][row, start:end] = np.arange(len(tokens))
            out["sequence_ids"][row, start:end] = slot + 1
            out["cls_positions"][row, slot] = start
            start = end
    return out


PAIR_SLOTS = ("anchor_slots", "positive_slots", "negative_slots")


def pair_rows(
    roles: list, chosen: np.ndarray, width: int, max_per_pack: int | None, algorithm: str, seed: int
) -> dict[str, np.ndarray]:
    """A contrastive step's rows: the texts of pairs `chosen` (roles: [anchors, positives
    (, negatives)] token id lists; the step's order) packed into rows of `width` tokens, and
    each text's place among the rows' slots flattened (pack * K + slot): anchor_slots,
    positive_slots (, negative_slots), int64 [len(chosen)] each (model.embedding.PackedContrastive reads them)."""
    texts = [role[i] for role in roles for i in chosen]
    table, place = pack_with_places(np.array([len(t) for t in texts]), width, max_per_pack, algorithm, seed)
    rows = pack_rows(texts, table, width)
    for r, name in enumerate(PAIR_SLOTS[: len(roles)]):
        rows[name] = place[r * len(chosen) : (r + 1) * len(chosen)]
    return rows


def unpack_outputs(per_slot: np.ndarray, example_index: np.ndarray, n: int) -> np.ndarray:
    """Per-slot outputs [packs, K, ...] back to input order [n, ...] through example_index
    [packs, K]; raises unless every example 0..n-1 appears exactly once."""
    present = example_index >= 0
    check_table(np.where(present, example_index, -1), n)
    out = np.empty((n, *per_slot.shape[2:]), dtype=per_slot.dtype)
    out[example_index[present]] = per_slot[present]
    return out


def unpack_token_outputs(
    row_values: np.ndarray, cls_positions: np.ndarray, example_index: np.ndarray, lengths: np.ndarray
) -> np.ndarray:
    """Per-token outputs of packed rows back to one row per example, in input order.

    row_values [R, S] (a start or end logit per row token); cls_positions, example_index
    [R, K]; lengths [n] tokens per example -> float32 [n, max(lengths)], -inf past each
    example's end. Raises unless every example 0..n-1 is present exactly once."""
    n = len(lengths)
    check_table(np.where(example_index >= 0, example_index, -1), n)
    longest = int(lengths.max()) if n else 0
    rows, slots = np.nonzero(example_index >= 0)
    example = example_index[rows, slots]
    steps = np.arange(longest)[None, :]
    inside = steps < lengths[example][:, None]
    columns = np.where(inside, cls_positions[rows, slots][:, None] + steps, 0)
    out = np.full((n, longest), -np.inf, dtype=np.float32)
    out[example] = np.where(inside, row_values[rows[:, None], columns], -np.inf)
    return out
