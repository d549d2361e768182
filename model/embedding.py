"""Packed sentence embeddings: one pooled vector per sequence of a pack.

from model.embedding import PackedBertForEmbedding
m = PackedBertForEmbedding.from_pretrained(folder, pooling="mean", normalize=True)
out = m(**rows)            # finetune.rows.pack_rows fields, as tensors
out["embeddings"]          # [B, K, D] float32; slots with example_index < 0 are zeros

Pooling is sentence-transformers' (its `Pooling` module's modes, computed per packed
sequence over that sequence's own tokens, [CLS] and [SEP] included, as its attention mask
does): `cls`, `max`, `mean`, `mean_sqrt_len_tokens`, `weightedmean`, `lasttoken`, or
several concatenated in the order given. `normalize` divides each vector by its L2 norm
(sentence-transformers' `Normalize`). Parameter names are a bare transformers `BertModel`'s
(what a sentence-transformers folder holds), under `bert.` here.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig

from common.choices import POOLING_MODES, check_pooling  # noqa: F401 - re-exported
from model.config import set_packing_defaults
from model.encoder import PackedBertModel, slot_masks
from model.hf_checkpoint import load_encoder_weights, read_config
from model.packed_rows import PackedRows, SlotRows


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


class PackedBertForEmbedding(PackedRows, nn.Module):
    """Every token -> per-sequence pooling (-> L2 normalisation), over this project's BERT
    encoder. Inference only: no loss, no labels, never saved; so a plain torch module, not a
    transformers PreTrainedModel as the trainable heads are (model/packed_head.py): that
    base costs seconds of imports a command that embeds does not need."""

    def __init__(self, config: BertConfig, pooling="mean", normalize: bool = False):
        super().__init__()
        set_packing_defaults(config)
        self.config = config
        self.bert = PackedBertModel(config, add_pooling_layer=False)
        self.pooling = check_pooling(pooling)
        self.normalize = bool(normalize)
        self.loading_report: dict = {}

    @property
    def dimension(self) -> int:
        """Length of one embedding: hidden size x pooling modes."""
        return self.config.hidden_size * len(self.pooling)

    def read_out(self, hidden, rows: SlotRows, labels, num_items_in_batch) -> dict:
        """hidden [B, S, H] -> embeddings [B, K, D] float32, and `example_index`."""
        embeddings = pool_slots(hidden, rows, self.pooling)
        if self.normalize:
            embeddings = F.normalize(embeddings, p=2, dim=-1)  # an absent slot's zeros stay zeros
        return {"embeddings": embeddings, "example_index": rows.example_index, "present": rows.present}

    @classmethod
    def from_pretrained(
        cls,
        folder,
        new_head: bool = False,
        config_dict=None,
        pooling="mean",
        normalize: bool = False,
        **overrides,
    ):
        """A BERT folder's encoder (a bare BertModel, as in sentence-transformers folders, or
        any BERT task model's `bert.*`), loaded strictly (model.hf_checkpoint.
        load_encoder_weights). overrides set non-shape config options (attention_backend,
        dropout); config_dict: config.json as already read (None: read here)."""
        folder = Path(folder)
        config = read_config(folder, overrides, config_dict)
        config.embedding_pooling = list(check_pooling(pooling))
        config.embedding_normalize = bool(normalize)
        model = cls.build(config)
        info = load_encoder_weights(model.bert, folder, config, new_head=new_head)
        model.loading_report = {key: list(value) for key, value in info.items() if value}
        return model

    @classmethod
    def build(cls, config: BertConfig):
        """The model for a config whose embedding_pooling / embedding_normalize are set."""
        return cls(config, config.embedding_pooling, config.embedding_normalize)
