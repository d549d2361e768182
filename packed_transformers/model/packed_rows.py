"""What every packed model shares, whatever its base class: the rows a head reads
(`SlotRows`), the outputs `Trainer` must not gather, and the forward over packed rows
(`PackedRows`: the encoder call, the read positions, then the head's `read_out`).

Kept apart from model/packed_head.py, whose `PackedHead` is a transformers PreTrainedModel
(for `Trainer`): importing that base costs seconds of start-up, which the inference-only
models (model/inference_head.py) do not pay.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from packed_transformers.model.config import set_packing_defaults
from packed_transformers.model.encoder import PackedBertModel, encode_rows
from packed_transformers.model.hf_checkpoint import read_config

# Outputs transformers' Trainer must not gather as predictions (metric sums, masks).
TRAINER_IGNORED_OUTPUTS = ["present", "loss_sum", "count", "correct", "correct_count"]


def examples_in(num_items_in_batch, items_per_example: int):
    """transformers' Trainer counts a step's items as `labels != -100` over its micro-batches
    (its num_items_in_batch): examples x items_per_example. -> examples, or None."""
    if num_items_in_batch is None:
        return None
    return num_items_in_batch / items_per_example


def present_slot_metrics(per_example, present, correct, correct_count) -> dict:
    """A head's loss and metric sums over present slots only (sums and counts, never means
    of means). per_example [B, K] losses (absent slots removed with torch.where, so even a
    non-finite loss there cannot leak into the sum); present bool [B, K]; correct: the
    head's hit count (a tensor); correct_count: what it is out of."""
    zero = torch.zeros((), dtype=per_example.dtype, device=per_example.device)
    example_loss = torch.where(present, per_example, zero)
    loss_sum = example_loss.sum()
    count = present.sum()
    return {
        "example_loss": example_loss.detach(),
        "loss": loss_sum / count.clamp(min=1),
        "loss_sum": loss_sum.detach(),
        "count": count,
        "correct": correct,
        "correct_count": correct_count,
    }


class SlotRows(NamedTuple):
    """What a head reads of the rows besides the hidden states."""

    sequence_ids: torch.Tensor  # [B, S]: j = 1..K on the tokens of slot j's sequence, 0 padding
    cls_positions: torch.Tensor  # [B, K]: where each slot's sequence starts
    example_index: torch.Tensor  # [B, K]: the example in each slot, < 0 where absent

    @property
    def slots(self) -> int:
        return self.cls_positions.shape[1]

    @property
    def present(self) -> torch.Tensor:
        return self.example_index >= 0


class PackedRows:
    """The forward of a packed head over `self.bert` (a model.encoder.PackedBertModel), mixed
    into a torch module. A head sets `reads_cls_only` and defines `read_out`."""

    reads_cls_only = False
    add_pooling_layer = False

    def add_encoder(self, config) -> None:
        """The packing defaults set on `config`, and `self.bert` built from it (a pooler where
        the head's `add_pooling_layer`); called by both bases' __init__."""
        set_packing_defaults(config)
        self.config = config
        self.bert = PackedBertModel(config, add_pooling_layer=self.add_pooling_layer)
        self.loading_report: dict = {}

    def forward(
        self,
        input_ids,
        segment_ids,
        position_ids,
        sequence_ids,
        cls_positions,
        example_index,
        labels=None,
        num_items_in_batch=None,
        **unused,
    ) -> dict:
        """Rows [B, S] and slots [B, K] (packs.rows.pack_rows' fields, as tensors) ->
        the head's outputs (`read_out`). Other fields are accepted and ignored."""
        rows = SlotRows(sequence_ids, cls_positions, example_index)
        # A head that reads only [CLS] has the last layer compute those rows alone (its
        # queries, attention output and feed-forward block; keys and values from every
        # token): about 5/6 of a layer's work saved, with the same outputs and gradients.
        read_positions = cls_positions if self.reads_cls_only else None
        hidden = self.encode(
            input_ids, segment_ids, position_ids, sequence_ids, cls_positions, read_positions
        )
        return self.read_out(hidden, rows, labels, num_items_in_batch)

    def read_out(self, hidden, rows: SlotRows, labels, num_items_in_batch) -> dict:
        """hidden [B, S, H] ([B, K, H] when reads_cls_only) -> the head's outputs."""
        raise NotImplementedError

    def encode(self, input_ids, segment_ids, position_ids, sequence_ids, slots, read_positions=None):
        """Rows -> hidden states; see `encode_rows`."""
        return encode_rows(
            self.bert, input_ids, segment_ids, position_ids, sequence_ids, slots, read_positions
        )

    # ----- what from_pretrained's arguments set (both bases: PackedHead, InferenceHead) ------------
    @classmethod
    def configure(cls, config, num_labels: int | None, overrides: dict, **options) -> None:
        """Set what `from_pretrained`'s arguments ask for in `config` (in place). The base
        sets num_labels, then id2label / label2id from the overrides (num_labels resets them)."""
        if options:
            raise TypeError(f"{cls.__name__}.from_pretrained got unexpected arguments {sorted(options)}")
        if num_labels is not None:
            config.num_labels = num_labels
        for key in ("id2label", "label2id"):
            if key in overrides:
                setattr(config, key, overrides[key])

    @classmethod
    def configure_options(cls) -> tuple[str, ...]:
        """Names `from_pretrained` hands to `configure` rather than to the config."""
        return ()

    @classmethod
    def build(cls, config):
        """The model for a configured config (a head with constructor options reads them there)."""
        return cls(config)

    @classmethod
    def configured(cls, folder, num_labels, config_dict, overrides: dict):
        """folder's config.json (or config_dict) with the overrides and `configure` applied."""
        options = {key: overrides.pop(key) for key in cls.configure_options() if key in overrides}
        config = read_config(folder, overrides, config_dict)
        cls.configure(config, num_labels, overrides, **options)
        return config
