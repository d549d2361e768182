"""Packed sentence embeddings: one pooled vector per sequence of a pack; and their contrastive
training (`PackedContrastive`: MultipleNegativesRankingLoss over a step's packed texts).

from packed_transformers.model.embedding import PackedBertForEmbedding
m = PackedBertForEmbedding.from_pretrained(folder, pooling="mean", normalize=True)
out = m(**rows)            # packs.rows.pack_rows fields, as tensors
out["embeddings"]          # [B, K, D] float32; slots with example_index < 0 are zeros

Pooling is sentence-transformers' (its `Pooling` module's modes, computed per packed
sequence over that sequence's own tokens, [CLS] and [SEP] included, as its attention mask
does): `cls`, `max`, `mean`, `mean_sqrt_len_tokens`, `weightedmean`, `lasttoken`, or
several concatenated in the order given. `normalize` divides each vector by its L2 norm
(sentence-transformers' `Normalize`). Parameter names are a bare transformers `BertModel`'s
(what a sentence-transformers folder holds), under `bert.` here.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig

from packed_transformers.common.choices import POOLING_MODES, check_pooling  # noqa: F401 - re-exported
from packed_transformers.model.encoder import slot_masks
from packed_transformers.model.inference_head import InferenceHead
from packed_transformers.model.outputs import PackedOutput
from packed_transformers.model.packed_rows import SlotRows


def pool_slots(hidden, rows: SlotRows, modes: tuple[str, ...]) -> torch.Tensor:
    """hidden [B, S, H] -> [B, K, H x len(modes)] float32: each slot's sequence pooled over its
    own tokens (zeros where a slot is absent)."""
    hidden = hidden.float()  # under bf16 autocast the sums still accumulate in float32
    own = slot_masks(rows.sequence_ids, rows.slots)  # [B, K, S]
    weights = own.to(hidden.dtype)
    counts = weights.sum(-1, keepdim=True)  # [B, K, 1] tokens per sequence
    first = rows.cls_positions.long()  # [B, K]
    pooled = []
    for mode in modes:
        if mode in ("mean", "mean_sqrt_len_tokens"):
            sums = torch.bmm(weights, hidden)  # [B, K, H]
            scale = counts.clamp(min=1e-9)
            pooled.append(sums / (scale if mode == "mean" else scale.sqrt()))
        elif mode == "weightedmean":
            # weight 1, 2, ... along each sequence from its first token
            offsets = torch.arange(hidden.shape[1], device=hidden.device)[None, None, :] - first[..., None]
            position_weights = weights * (offsets + 1).to(hidden.dtype)
            sums = torch.bmm(position_weights, hidden)
            pooled.append(sums / position_weights.sum(-1, keepdim=True).clamp(min=1e-9))
        elif mode in ("cls", "lasttoken"):
            at = first if mode == "cls" else first + counts.squeeze(-1).long().clamp(min=1) - 1
            index = at[..., None].expand(-1, -1, hidden.shape[-1])
            pooled.append(torch.gather(hidden, 1, index))
        else:  # max: one slot at a time, so that no [B, K, S, H] tensor is ever built
            floor = torch.finfo(hidden.dtype).min
            pooled.append(
                torch.stack(
                    [torch.where(own[:, k, :, None], hidden, floor).amax(1) for k in range(rows.slots)], 1
                )
            )
    out = torch.cat(pooled, -1)
    return torch.where(rows.present[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))


class PackedBertForEmbedding(InferenceHead):
    """Every token -> per-sequence pooling (-> L2 normalisation), over this project's BERT
    encoder. Inference only (no loss, no labels, never saved): a plain torch module
    (model.inference_head), loading a bare BertModel's names as sentence-transformers
    folders hold them, or any BERT task model's `bert.*`."""

    reference_class = "BertModel"
    reference_options = {"add_pooling_layer": False}
    base_model_only = True

    def __init__(self, config: BertConfig, pooling="mean", normalize: bool = False):
        super().__init__(config)
        self.pooling = check_pooling(pooling)
        self.normalize = bool(normalize)

    @property
    def dimension(self) -> int:
        """Length of one embedding: hidden size x pooling modes."""
        return self.config.hidden_size * len(self.pooling)

    def read_out(self, hidden, rows: SlotRows, labels, num_items_in_batch) -> dict:
        """hidden [B, S, H] -> embeddings [B, K, D] float32, and `example_index`."""
        embeddings = pool_slots(hidden, rows, self.pooling)
        if self.normalize:
            embeddings = F.normalize(embeddings, p=2, dim=-1)  # an absent slot's zeros stay zeros
        return PackedOutput(embeddings=embeddings, example_index=rows.example_index, present=rows.present)

    @classmethod
    def configure_options(cls) -> tuple[str, ...]:
        return ("pooling", "normalize")

    @classmethod
    def configure(cls, config, num_labels, overrides, pooling="mean", normalize=False) -> None:
        super().configure(config, num_labels, overrides)
        config.embedding_pooling = list(check_pooling(pooling))
        config.embedding_normalize = bool(normalize)

    @classmethod
    def build(cls, config: BertConfig):
        """The model for a config whose embedding_pooling / embedding_normalize are set."""
        return cls(config, config.embedding_pooling, config.embedding_normalize)


# ----- contrastive training of an embedding model -----------------------------------------
# Contrastive training of an embedding model on packed rows: every text of a step (anchors,
# positives, hard negatives) packed into rows, each pooled over its own tokens by the packed
# embedding model, then scored all against all: sentence-transformers'
# MultipleNegativesRankingLoss (in-batch negatives, InfoNCE).
#
#     model = PackedContrastive(embedder, scale=20.0, symmetric=False)
#     out = model(**rows, anchor_slots=a, positive_slots=p, negative_slots=n)
#     out["loss"]      # mean over the step's anchors; out["loss_sum"], ["count"], ["correct"]
#
# rows: packs.rows.pack_rows' fields for the step's texts; anchor_slots, positive_slots,
# negative_slots: int64 [B] (negatives [B] or absent), each text's place among the rows' slots
# flattened ([rows x K]; packs.rows.pair_rows makes them). Packing changes only where a
# text sits, never which texts form the step: the loss is the padded computation's
# (tests/finetune/test_contrastive.py holds them equal per parameter's gradient).
#
# The loss, as sentence-transformers computes it: cosine similarity of every anchor with every
# positive (and every hard negative) of the step, times `scale`; cross-entropy with anchor i's
# own positive as its class. symmetric: also every positive against the anchors, the two
# cross-entropies averaged (MultipleNegativesSymmetricRankingLoss).


def flat_slots(embeddings: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """embeddings [rows, K, D], slots int64 [N] (row * K + slot) -> [N, D]."""
    return embeddings.reshape(-1, embeddings.shape[-1]).index_select(0, slots)


def ranking_loss(
    anchors: torch.Tensor,
    candidates: torch.Tensor,
    scale: float,
    symmetric: bool = False,
    first: int = 0,
    all_anchors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """anchors [b, D]: the step's anchors first .. first + b - 1 (all of them where first is 0
    and all_anchors None); candidates [B + M, D]: the step's B positives first (positive i
    belongs to anchor i), then M hard negatives; all_anchors [B, D]: the step's every anchor
    (symmetric, where `anchors` are a process's share) -> (per-anchor losses [b], hits [b]: the
    anchor's own positive scored highest)."""
    scores = scale * F.normalize(anchors, dim=-1) @ F.normalize(candidates, dim=-1).T  # [b, B + M]
    target = torch.arange(first, first + len(anchors), device=anchors.device)
    losses = F.cross_entropy(scores, target, reduction="none")
    if symmetric:  # each of these anchors' positives against every anchor of the step
        everyone = anchors if all_anchors is None else all_anchors
        positives = candidates[first : first + len(anchors)]
        reverse = scale * F.normalize(positives, dim=-1) @ F.normalize(everyone, dim=-1).T  # [b, B]
        losses = (losses + F.cross_entropy(reverse, target, reduction="none")) / 2
    return losses, scores.argmax(-1) == target


def gathered(local: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every process's rows of a step, in process order, and where this process's begin:
    local [n, D] -> ([sum of n, D], offset). The gradient of each row flows back to the
    process that computed it (torch.distributed.nn's all_gather), as sentence-transformers'
    `gather_across_devices` does. The rows themselves and 0 without a process group."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return local, 0
    from torch.distributed.nn.functional import all_gather

    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = torch.zeros(world, dtype=torch.long, device=local.device)
    sizes[rank] = len(local)
    dist.all_reduce(sizes)  # processes may hold different numbers of texts: padded to the most
    sizes = sizes.tolist()
    padded = torch.cat([local, local.new_zeros((max(sizes) - len(local), local.shape[-1]))])
    parts = all_gather(padded)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)]), sum(sizes[:rank])


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

    def forward(self, anchor_slots=None, positive_slots=None, negative_slots=None, **rows) -> dict:
        """Under torchrun each process holds a share of the step's pairs: its anchors are
        scored against every process's positives and negatives (`gathered`); its loss is the
        mean over its own anchors (0 where it holds none), its count theirs. Without slots:
        the embeddings alone (validation calls this module, not `embedder`, so that FSDP2's
        hooks gather the weights)."""
        embeddings = self.embedder(**rows)["embeddings"]  # [rows, K, D] float32
        if anchor_slots is None:
            return {"embeddings": embeddings}
        anchors = flat_slots(embeddings, anchor_slots)
        all_anchors, first = gathered(anchors)
        candidates = [gathered(flat_slots(embeddings, positive_slots))[0]]
        if negative_slots is not None:
            negatives = gathered(flat_slots(embeddings, negative_slots))[0]
            candidates += [negatives] if len(negatives) else []
        losses, hits = ranking_loss(
            anchors, torch.cat(candidates), self.scale, self.symmetric, first, all_anchors
        )
        count = torch.tensor(len(anchors), device=anchors.device)
        return {
            "loss": losses.sum() / max(len(anchors), 1),
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
        state = {k[len("bert.") :]: v for k, v in embedder.state_dict().items() if k.startswith("bert.")}
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
