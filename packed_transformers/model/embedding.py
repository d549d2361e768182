"""Packed sentence embeddings: one pooled vector per sequence of a pack.

from packed_transformers.model.embedding import PackedBertForEmbedding
m = PackedBertForEmbedding.from_pretrained(folder, pooling="mean", normalize=True)
out = m(**rows)            # inference.rows.pack_rows fields, as tensors
out["embeddings"]          # [B, K, D] float32; slots with example_index < 0 are zeros

Pooling is sentence-transformers' (its `Pooling` module's modes, computed per packed
sequence over that sequence's own tokens, [CLS] and [SEP] included, as its attention mask
does): `cls`, `max`, `mean`, `mean_sqrt_len_tokens`, `weightedmean`, `lasttoken`, or
several concatenated in the order given. `normalize` divides each vector by its L2 norm
(sentence-transformers' `Normalize`). Parameter names are a bare transformers `BertModel`'s
(what a sentence-transformers folder holds), under `bert.` here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
