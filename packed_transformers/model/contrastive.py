"""Contrastive training of an embedding model on packed rows: every text of a step (anchors,
positives, hard negatives) packed into rows, each pooled over its own tokens by the packed
embedding model, then scored all against all: sentence-transformers'
MultipleNegativesRankingLoss (in-batch negatives, InfoNCE).

    model = PackedContrastive(embedder, scale=20.0, symmetric=False)
    out = model(**rows, anchor_slots=a, positive_slots=p, negative_slots=n)
    out["loss"]      # mean over the step's anchors; out["loss_sum"], ["count"], ["correct"]

rows: inference.rows.pack_rows' fields for the step's texts; anchor_slots, positive_slots,
negative_slots: int64 [B] (negatives [B] or absent), each text's place among the rows' slots
flattened ([rows x K]; finetune.contrastive_task makes them). Packing changes only where a
text sits, never which texts form the step: the loss is the padded computation's
(tests/finetune/test_contrastive.py holds them equal per parameter's gradient).

The loss, as sentence-transformers computes it: cosine similarity of every anchor with every
positive (and every hard negative) of the step, times `scale`; cross-entropy with anchor i's
own positive as its class. symmetric: also every positive against the anchors, the two
cross-entropies averaged (MultipleNegativesSymmetricRankingLoss).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def flat_slots(embeddings: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """embeddings [rows, K, D], slots int64 [N] (row * K + slot) -> [N, D]."""
    return embeddings.reshape(-1, embeddings.shape[-1]).index_select(0, slots)


def ranking_loss(
    anchors: torch.Tensor, candidates: torch.Tensor, scale: float, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """anchors [B, D], candidates [B + M, D] (the B positives first, then M hard negatives)
    -> (per-anchor losses [B], hits [B]: the anchor's own positive scored highest)."""
    scores = scale * F.normalize(anchors, dim=-1) @ F.normalize(candidates, dim=-1).T  # [B, B + M]
    target = torch.arange(len(anchors), device=anchors.device)
    losses = F.cross_entropy(scores, target, reduction="none")
    if symmetric:  # each positive against every anchor
        backward = F.cross_entropy(scores[:, : len(anchors)].T, target, reduction="none")
        losses = (losses + backward) / 2
    return losses, scores.argmax(-1) == target


class PackedContrastive(nn.Module):
    """A packed embedding model (model.embedding.PackedBertForEmbedding or a family's
    PackedFamilyModel for "embedding") trained by MultipleNegativesRankingLoss. `embedder`
    is kept under that name: the saved weights are its own."""

    def __init__(self, embedder: nn.Module, scale: float = 20.0, symmetric: bool = False):
        super().__init__()
        self.embedder = embedder
        self.scale, self.symmetric = float(scale), bool(symmetric)

    @property
    def config(self):
        return self.embedder.config

    @property
    def dimension(self) -> int:
        return self.embedder.dimension

    def forward(self, anchor_slots, positive_slots, negative_slots=None, **rows) -> dict:
        embeddings = self.embedder(**rows)["embeddings"]  # [rows, K, D] float32
        anchors = flat_slots(embeddings, anchor_slots)
        candidates = flat_slots(embeddings, positive_slots)
        if negative_slots is not None and len(negative_slots):
            candidates = torch.cat([candidates, flat_slots(embeddings, negative_slots)])
        losses, hits = ranking_loss(anchors, candidates, self.scale, self.symmetric)
        count = torch.tensor(len(anchors), device=anchors.device)
        return {
            "loss": losses.mean(),
            "loss_sum": losses.sum().detach(),
            "count": count,
            "correct": hits.sum(),
            "correct_count": count,
        }


def encoder_weights(embedder: nn.Module) -> dict[str, torch.Tensor]:
    """A packed embedding model's encoder tensors under transformers' names (a tied tensor
    once): this project's BERT's under `bert.` as BertModel names them, a family's its
    transformers module's own. What a sentence-transformers folder's Transformer module holds."""
    if hasattr(embedder, "bert"):
        state = {k.removeprefix("bert."): v for k, v in embedder.state_dict().items() if k.startswith("bert.")}
    else:
        state = embedder.hf_model.state_dict()
    seen, weights = set(), {}
    for name, tensor in state.items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            weights[name] = tensor.detach().cpu().contiguous()
    return weights


def retrieval_scores(anchors: np.ndarray, positives: np.ndarray) -> dict:
    """Anchor i's relevant document is positive i, among every positive, by cosine
    similarity: nDCG@10 (one relevant each), recall@1 and recall@10."""
    a = anchors / np.maximum(np.linalg.norm(anchors, axis=1, keepdims=True), 1e-12)
    p = positives / np.maximum(np.linalg.norm(positives, axis=1, keepdims=True), 1e-12)
    scores = a @ p.T
    rank = (scores > scores[np.arange(len(a)), np.arange(len(a))][:, None]).sum(1)  # 0: first
    return {
        "ndcg@10": float(np.where(rank < 10, 1 / np.log2(rank + 2), 0).mean()),
        "recall@1": float((rank < 1).mean()),
        "recall@10": float((rank < 10).mean()),
    }
