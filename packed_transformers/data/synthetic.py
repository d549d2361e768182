"""Synthetic unpacked shards with a given length distribution (benchmarks and tests).

Rows look like phase-2 data: [CLS] A [SEP] B [SEP], random word-piece ids, 15% of the
tokens masked (at most P), NSP labels 0/1. Only the lengths are realistic: they are drawn
from a histogram such as the published Wikipedia-512 one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from packed_transformers.common.constants import BERT_VOCAB_SIZE
from packed_transformers.common.files import atomic_path
from packed_transformers.packs.unpacked_hdf5 import DTYPES, create_unpacked_datasets

CLS, SEP = 101, 102


def synthetic_rows(
    lengths: np.ndarray, s: int, p: int, rng: np.random.Generator, vocab_size: int = BERT_VOCAB_SIZE
) -> dict:
    """Unpacked rows for the given lengths (each >= 3): dict of the six fields."""
    n = lengths.size
    col = np.arange(s)[None, :]
    real = col < lengths[:, None]
    ids = rng.integers(1000, vocab_size, size=(n, s), dtype=np.int32) * real
    split = 1 + (rng.random(n) * (lengths - 2)).astype(np.int64)  # index of the first [SEP]
    split = np.clip(split, 1, lengths - 2)
    ids[:, 0] = CLS
    ids[np.arange(n), split] = SEP
    ids[np.arange(n), lengths - 1] = SEP
    segments = ((col > split[:, None]) & real).astype(np.int8)
    predictions = np.clip(np.round(0.15 * lengths).astype(np.int64), 1, p)
    predictions = np.minimum(predictions, lengths - 1)
    keys = rng.random((n, s))
    keys[~real] = 2.0
    keys[:, 0] = 3.0  # never mask [CLS]
    chosen = np.sort(np.argsort(keys, axis=1)[:, :p], axis=1)
    used = np.arange(p)[None, :] < predictions[:, None]
    # keep the chosen positions of used slots, sorted, and zeros after them
    positions = np.where(used, chosen, 0)
    positions = np.sort(np.where(used, positions, s + 1), axis=1)
    positions[positions == s + 1] = 0
    labels = np.where(positions > 0, np.take_along_axis(ids, positions, axis=1), 0)
    return {
        "input_ids": ids,
        "input_mask": real.astype(np.int8),
        "segment_ids": segments,
        "masked_lm_positions": positions,
        "masked_lm_ids": labels,
        "next_sentence_labels": rng.integers(0, 2, size=n, dtype=np.int8),
    }


def write_synthetic_shards(
    folder: Path,
    counts: np.ndarray,
    sequences: int,
    rows_per_file: int,
    seed: int = 0,
    p: int = 76,
    chunk: int = 1 << 14,
) -> list[Path]:
    """Shards part-NNNNN.h5 with `sequences` rows whose lengths follow histogram `counts`
    (counts[i] = sequences of length i + 1; lengths below 3 are raised to 3)."""
    import h5py

    folder.mkdir(parents=True, exist_ok=True)
    s = counts.size
    rng = np.random.default_rng(seed)
    weights = np.asarray(counts, dtype=np.float64) / np.sum(counts)
    paths = []
    for index, start in enumerate(range(0, sequences, rows_per_file)):
        rows = min(rows_per_file, sequences - start)
        path = folder / f"part-{index:05d}.h5"
        with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
            datasets = create_unpacked_datasets(f, rows, s, p, DTYPES)
            for a in range(0, rows, chunk):
                b = min(rows, a + chunk)
                lengths = np.maximum(rng.choice(s, size=b - a, p=weights) + 1, 3)
                for name, values in synthetic_rows(lengths, s, p, rng).items():
                    datasets[name][a:b] = values
        paths.append(path)
    return paths
