"""The packed format's structure rules, checked on whole blocks of packs at once.

`first_malformed` is what the training reader runs on every micro-batch it reads (a few
vectorised numpy passes over [B, S]: 0.6 ms for 32 packs of 512 tokens on this
project's 2-core machine, in the loader's workers), so that a
hostile or damaged shard whose metadata is consistent is refused naming the shard and
the pack, before the model sees it. The rules are ARCHITECTURE.md section 3's:

- sequence_ids: each sequence one contiguous run, runs numbered 1, 2, ..., k in order
  from position 0, k <= K, padding (0) only after the last run;
- position_ids: 0, 1, ... within each run;
- next_sentence_positions / weights: slot j-1 holds run j's first token and weight 1,
  slots past k weight 0;
- masked_lm_weights: the number of the run the masked position lies in (0 = unused);
- input_ids below the model's vocabulary, segment_ids below its token-type count.

`components.batch_check.validate_batch` (the debug option, on tensors) checks what is
particular to tensors and calls this for the rules: they are stated here only.
"""

from __future__ import annotations

import numpy as np


def first_malformed(
    fields: dict, vocab_size: int | None = None, type_vocab_size: int | None = None
) -> tuple[int, str] | None:
    """(row, what is wrong) of the first row of `fields` (numpy [B, width] arrays of the
    packed fields) that breaks a rule, or None when every row holds."""
    ids = fields["sequence_ids"].astype(np.int16)
    b, s = ids.shape
    k = fields["next_sentence_positions"].shape[1]
    bad: list[tuple[int, str]] = []

    def flag(rows_mask: np.ndarray, message: str) -> None:
        rows = np.flatnonzero(rows_mask)
        if rows.size:
            bad.append((int(rows[0]), message))

    if vocab_size is not None:
        flag(
            (fields["input_ids"] >= vocab_size).any(axis=1),
            f"input_ids hold a token id >= model.vocab_size {vocab_size}",
        )
    if type_vocab_size is not None:
        flag(
            (fields["segment_ids"] >= type_vocab_size).any(axis=1),
            f"segment_ids hold a value >= the model's type_vocab_size {type_vocab_size}",
        )
    real = ids > 0
    n_real = np.count_nonzero(real, axis=1)
    step = np.diff(ids, axis=1)  # int16: ids are at most 255
    flag((~real[:, :-1] & real[:, 1:]).any(axis=1), "padding before a real token")
    runs = ids.max(axis=1) if s else np.zeros(b, np.int16)
    flag(runs > k, f"a sequence id above K={k}")
    both_real = real[:, 1:] & real[:, :-1]
    flag(
        ((n_real > 0) & (ids[:, 0] != 1)) | (both_real & (step != 0) & (step != 1)).any(axis=1),
        "sequence_ids are not contiguous runs 1, 2, ... from position 0",
    )
    positions = fields["position_ids"].astype(np.int32)
    # within a run each position is the previous one + 1; a new run (step 1) starts at 0
    expected_next = positions[:, :-1] + 1
    expected_next[step == 1] = 0
    flag(
        ((n_real > 0) & (positions[:, 0] != 0))
        | (both_real & (positions[:, 1:] != expected_next)).any(axis=1),
        "position_ids do not run 0, 1, ... within each sequence",
    )
    weights = fields["next_sentence_weights"].astype(np.int64)
    flag(
        (weights != (np.arange(k)[None, :] < np.minimum(runs, k)[:, None])).any(axis=1),
        "next_sentence_weights do not mark exactly the slots that hold a sequence",
    )
    starts_row, starts_col = np.nonzero(real & (positions == 0))
    slot = np.clip(ids[starts_row, starts_col] - 1, 0, max(k - 1, 0))
    if k:
        wrong_start = fields["next_sentence_positions"][starts_row, slot].astype(np.int64) != starts_col
        flag(
            np.bincount(starts_row[wrong_start], minlength=b) > 0,
            "next_sentence_positions do not point at each sequence's first token",
        )
    mlm_weights = fields["masked_lm_weights"].astype(np.int64)
    mlm_positions = fields["masked_lm_positions"].astype(np.int64)
    used = mlm_weights > 0
    flag((used & (mlm_positions >= s)).any(axis=1), f"masked_lm_positions beyond S={s}")
    owner = np.take_along_axis(ids, np.minimum(mlm_positions, max(s - 1, 0)), axis=1).astype(np.int64)
    flag(
        (used & (owner != mlm_weights)).any(axis=1),
        "a masked position lies outside the sequence its masked_lm_weights names (on padding or another one)",
    )
    return min(bad, key=lambda found: found[0]) if bad else None  # ties: the first rule broken
