"""Synthetic packs for throughput checks (`data.synthetic: true`): no file is read.

Pack i is a pure function of (seed, i): `round(packing_factor)`-ish random sequences
(floor or ceil of the factor, so that the mean is the factor) that fill all S tokens,
about 15% of each sequence's tokens masked, random NSP labels, laid out by the packed
format's own `pack_sequences`, so every batch is well formed (components.batch_check.validate_batch)
and has the static shapes of a real packed dataset with the same S and K. The numbers a
model learns from them mean nothing; their cost per step is that of real full packs.

`SyntheticPacks` stands in for both the opened dataset (`metadata`, `sequences`, `packs`)
and the reader (`len`, `__getitem__(pack indices)`), so the run's sampler, loader and
engines are the ones real data goes through.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import Dataset

from packed_transformers.packing.format import Sequence, pack_sequences

SYNTHETIC_PACKS = 1 << 20  # an epoch; packs are made on demand, so only the order costs memory
MASKED_FRACTION = 0.15
FIRST_TOKEN_ID = 5  # ids below are BERT's special tokens ([PAD], [UNK], [CLS], [SEP], [MASK])


def mlm_slots(s: int, k: int) -> int:
    """M of synthetic packs: 15% of S plus one per sequence for rounding up."""
    return math.ceil(MASKED_FRACTION * s) + k


class SyntheticPacks(Dataset):
    def __init__(self, s: int, k: int, packing_factor: float, vocab_size: int, seed: int):
        if not 1 <= packing_factor <= k:
            raise ValueError(f"packing factor {packing_factor} is not in [1, K={k}]")
        if s < 8 * k:
            raise ValueError(f"S={s} is too short for K={k} synthetic sequences of at least 8 tokens")
        self.s, self.k, self.m = s, k, mlm_slots(s, k)
        self.packing_factor, self.vocab_size, self.seed = packing_factor, vocab_size, seed
        self.packs = SYNTHETIC_PACKS
        self.sequences = round(SYNTHETIC_PACKS * packing_factor)
        self.metadata = {
            "S": s,
            "K": k,
            "M": self.m,
            "packs": self.packs,
            "sequences": self.sequences,
            "packing_factor": packing_factor,
            "vocab_size": vocab_size,
            "synthetic": True,
        }

    def __len__(self) -> int:
        return self.packs

    def _pack(self, index: int) -> list[Sequence]:
        rng = np.random.default_rng([self.seed, index])
        whole, fraction = divmod(self.packing_factor, 1.0)
        count = min(self.k, int(whole) + int(rng.random() < fraction))
        spare = self.s - 8 * count  # every sequence at least 8 tokens, all S tokens used
        lengths = 8 + rng.multinomial(spare, np.full(count, 1.0 / count))
        sequences = []
        for index_in_pack, length in enumerate(lengths.tolist()):
            masked = max(1, round(MASKED_FRACTION * length))
            positions = np.sort(rng.choice(np.arange(1, length), size=masked, replace=False))
            first_segment = length // 2
            sequences.append(
                Sequence(
                    input_ids=rng.integers(FIRST_TOKEN_ID, self.vocab_size, size=length),
                    segment_ids=(np.arange(length) >= first_segment).astype(np.int64),
                    masked_lm_positions=positions,
                    masked_lm_ids=rng.integers(FIRST_TOKEN_ID, self.vocab_size, size=masked),
                    next_sentence_label=int(rng.integers(0, 2)),
                    source_index=index * self.k + index_in_pack,
                )
            )
        return sequences

    def __getitem__(self, packs) -> dict:
        """Pack indices [B] -> the packed fields as [B, ...] tensors (PackedShards' dtypes)."""
        rows = pack_sequences([self._pack(int(i)) for i in packs], self.s, self.k, self.m, self.vocab_size)
        return {
            name: torch.from_numpy(values.astype(np.int64 if name == "source_index" else np.int32))
            for name, values in rows.items()
        }
