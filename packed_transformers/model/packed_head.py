"""The one base of every packed head: the encoder call, the read positions, the
per-sequence read-out, and the Hugging Face naming for loading and saving.

A head on this base declares the transformers class it mirrors (`reference_class`,
whose parameter names it keeps: `bert.*` plus its own layers), whether it has a pooler,
and its `forward`; everything else is here:

    class PackedBertForX(PackedHead):
        reference_class = "BertForX"
        reads_cls_only = False        # True: the last layer computes the [CLS] rows only
        def __init__(self, config):
            super().__init__(config)
            self.x = nn.Linear(config.hidden_size, ...)
        def read_out(self, hidden, rows: SlotRows, labels, num_items_in_batch) -> dict:
            ...                       # hidden [B, S, H] ([B, K, H] if reads_cls_only)

Rows are packs.rows.pack_rows' fields: tokens [B, S], slots [B, K] (K sequences per
row at most; `cls_positions` [B, K] are where each one starts, `example_index` [B, K] < 0
in absent slots). Unpacked batches are the K = 1 case.
"""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import BertConfig, BertPreTrainedModel

from packed_transformers.model.hf_checkpoint import adopt_weights, reference_state, save_as_reference
from packed_transformers.model.packed_rows import TRAINER_IGNORED_OUTPUTS, PackedRows, SlotRows, examples_in  # noqa: F401 - re-exported


class PackedHead(PackedRows, BertPreTrainedModel):
    """A transformers PreTrainedModel, so that `Trainer` saves it as a folder, checkpoints
    and resumes it; it accepts Trainer's `num_items_in_batch` (gradient accumulation
    normalises by the items of the whole step).

    Subclasses set `reference_class` (the transformers class whose names and folder
    layout they keep), `add_pooling_layer`, and may override `configure` (what
    `from_pretrained`'s arguments set in the config) and `reference_options`."""

    accepts_loss_kwargs = True
    reference_class: str = ""
    add_pooling_layer = False
    reads_cls_only = False
    reference_options: dict = {}
    # The reference is a bare BertModel (names without "bert."), as in sentence-transformers folders.
    base_model_only = False

    def __init__(self, config: BertConfig):
        super().__init__(config)
        config.keys_to_ignore_at_inference = TRAINER_IGNORED_OUTPUTS
        self.add_encoder(config)

    # ----- Hugging Face checkpoints -----------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, folder, num_labels: int | None = None, new_head: bool = False, config_dict=None, **overrides
    ):
        """Read an HF BERT folder: a fine-tuned `reference_class`, or any BERT encoder
        (BertModel, BertForPreTraining) whose head layers are then initialised and named in
        `loading_report` and the log. num_labels must match a fine-tuned checkpoint's head;
        overrides set non-shape options (dropout, attention_backend, ...); options a
        subclass's `configure` names (problem_type, ...) are passed to it. Loaded strictly
        (model.hf_checkpoint.load_checked): new_head=True where fine-tuning starts from an
        encoder (a head absent from the file is initialised); False (inference) refuses it.
        config_dict: config.json as already read (None: read here)."""
        folder = Path(folder)
        config = cls.configured(folder, num_labels, config_dict, overrides)
        state, info = reference_state(
            cls.reference_class, folder, config, new_head, cls.reference_options, cls.base_model_only
        )
        model = cls.build(config)  # after the reference: its head's init draws first, as before
        # A new task's head is always initialised: that is news, not a warning.
        adopt_weights(model, state, info, folder, level=logging.INFO)
        return model

    def save_pretrained(self, folder, **trainer_options) -> None:
        """A folder `reference_class` loads as is (safetensors, config.json). Atomic:
        temporary folder, then rename. Trainer's options (state_dict, safe_serialization)
        are accepted; the weights saved are the model's."""
        save_as_reference(
            self, self.reference_class, folder, strip_prefix="bert." if self.base_model_only else ""
        )
