"""Training rows in a seeded, resumable order, split over replicas.

The order: epoch e is a permutation of the rows seeded by (shuffle_seed, e). Global batch g
of a step is rows [g * B, (g + 1) * B) of that order (B = micro_batch_rows x gradient
accumulation x replicas, an epoch's last partial batch wrapping into the next epoch's
order), and replica r takes every world-th row of it from r. So where a run is is one number,
the samples consumed, and a resumed run reads exactly the rows it would have read.
"""

from __future__ import annotations

import numpy as np
import torch

from packed_transformers.packs.lm_rows.store import RowStore


def row_order(rows: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(rows)


def global_batch_rows(rows: int, seed: int, first_sample: int, count: int) -> np.ndarray:
    """Row indices of samples first_sample .. first_sample + count - 1 of the run's order."""
    out = []
    sample = first_sample
    while len(out) < count:
        epoch, offset = divmod(sample, rows)
        take = min(rows - offset, count - len(out))
        out.extend(row_order(rows, seed, epoch)[offset : offset + take].tolist())
        sample += take
    return np.asarray(out, dtype=np.int64)


def micro_batches(store: RowStore, indices: np.ndarray, rank: int, world: int, per_micro_batch: int):
    """This replica's rows of one global batch, as [per_micro_batch, S] int64 tensors per
    micro-batch: input_ids, segment_ids (zeros), position_ids, sequence_ids."""
    mine = indices[rank::world]
    for start in range(0, len(mine), per_micro_batch):
        fields = store.batch(mine[start : start + per_micro_batch])
        batch = {name: torch.from_numpy(values) for name, values in fields.items()}
        batch["segment_ids"] = torch.zeros_like(batch["input_ids"])
        yield batch


def evaluation_batches(store: RowStore, rows: int, rank: int, world: int, per_micro_batch: int):
    """The first `rows` evaluation rows, split over replicas (each row on one replica)."""
    yield from micro_batches(store, np.arange(rows, dtype=np.int64), rank, world, per_micro_batch)
