"""Random unpacked sequences, their packed batch, and the same as an HF batch."""

import numpy as np
import torch

from packed_transformers.packing.format import Sequence, pack_sequences


def random_sequences(rng, count, vocab, min_len=3, max_len=20, max_predictions=4):
    out = []
    for i in range(count):
        length = int(rng.integers(min_len, max_len + 1))
        ids = rng.integers(5, vocab, size=length)
        ids[0] = 2  # [CLS]
        split = int(rng.integers(1, length))
        segments = (np.arange(length) >= split).astype(np.int64)
        p = int(rng.integers(1, min(max_predictions, length - 1) + 1))
        positions = np.sort(rng.choice(np.arange(1, length), size=p, replace=False))
        out.append(
            Sequence(
                ids,
                segments,
                positions,
                rng.integers(5, vocab, size=p),
                int(rng.integers(0, 2)),
                source_index=i,
            )
        )
    return out


def group_into_packs(sequences, s, k):
    packs, current, used = [], [], 0
    for seq in sequences:
        if len(current) == k or used + len(seq.input_ids) > s:
            packs.append(current)
            current, used = [], 0
        current.append(seq)
        used += len(seq.input_ids)
    packs.append(current)
    return packs


def packed_batch(packs, s, k, m, vocab):
    arrays = pack_sequences(packs, s, k, m, vocab)
    return {name: torch.from_numpy(a.astype(np.int64)) for name, a in arrays.items()}


def hf_batch(sequences):
    """Unpacked, right-padded batch with HF's labels (-100 = not masked)."""
    longest = max(len(s.input_ids) for s in sequences)
    n = len(sequences)
    ids = torch.zeros(n, longest, dtype=torch.long)
    seg = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, s in enumerate(sequences):
        length = len(s.input_ids)
        ids[i, :length] = torch.from_numpy(s.input_ids)
        seg[i, :length] = torch.from_numpy(s.segment_ids)
        mask[i, :length] = 1
        labels[i, torch.from_numpy(s.masked_lm_positions)] = torch.from_numpy(s.masked_lm_ids)
    nsp = torch.tensor([s.next_sentence_label for s in sequences])
    return dict(
        input_ids=ids, token_type_ids=seg, attention_mask=mask, labels=labels, next_sentence_label=nsp
    )
