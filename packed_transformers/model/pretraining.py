"""PackedBertForPreTraining: packs in, the unpacked BERT's numbers out.

from packed_transformers.model import PackedBertForPreTraining
m = PackedBertForPreTraining.from_pretrained(folder)     # any HF BERT folder
out = m(**batch)   # packed fields of ARCHITECTURE.md section 3, as tensors
out["loss"], out["mlm_correct"], out["mlm_count"], ...
"""

from __future__ import annotations

from pathlib import Path

from torch import nn
from transformers import BertConfig

from packed_transformers.model.config import set_packing_defaults
from packed_transformers.model.encoder import PackedBertModel, PositionGather, encode_rows
from packed_transformers.model.heads import PretrainingHeads, mlm_metrics, nsp_metrics
from packed_transformers.model.hf_checkpoint import (
    adopt_weights,
    hf_model_class,
    load_reference,
    read_config,
    reference_model,
    save_folder,
)

# The packed fields `heads` takes after sequence_output, in its argument order (a pipeline's
# last stage and the IPU graph feed them by this list).
HEAD_INPUTS = (
    "masked_lm_positions",
    "masked_lm_ids",
    "masked_lm_weights",
    "next_sentence_positions",
    "next_sentence_labels",
    "next_sentence_weights",
)


class PackedBertForPreTraining(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = set_packing_defaults(config)
        self.bert = PackedBertModel(config)
        self.cls = PretrainingHeads(config)
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight  # tied
        self.mlm_gather = PositionGather()  # the masked positions' rows of the sequence output
        self.loading_report: dict = {}
        self.apply(self._init_weights)

    def _init_weights(self, module):
        """BERT's initialisation: normal(0, initializer_range), zero biases, unit LayerNorm."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    # ----- the forward pass -------------------------------------------------------------
    def forward(self, input_ids, segment_ids, position_ids, sequence_ids, **fields) -> dict:
        """Packed batch -> outputs, losses, sums and counts. Tokens [B, S]; `fields` hold the
        HEAD_INPUTS: masked_lm_* [B, M] and next_sentence_* [B, K]. Extra fields (e.g.
        source_index) are accepted and ignored."""
        head_inputs = [fields[name] for name in HEAD_INPUTS]
        sequence_output = encode_rows(
            self.bert, input_ids, segment_ids, position_ids, sequence_ids, fields["next_sentence_positions"]
        )
        return self.heads(sequence_output, *head_inputs)

    # fmt: off
    def heads(self, sequence_output,
              masked_lm_positions, masked_lm_ids, masked_lm_weights,                  # [B, M]
              next_sentence_positions, next_sentence_labels, next_sentence_weights,   # [B, K]
              ) -> dict:
        # fmt: on
        """The last pipeline stage: MLM on gathered masked positions, NSP per [CLS]."""
        pooled = self.bert.pooler(sequence_output, next_sentence_positions)  # [B, K, H]
        mlm_logits = self.cls.predictions(self.mlm_gather(sequence_output, masked_lm_positions))
        nsp_logits = self.cls.seq_relationship(pooled)  # [B, K, 2]
        out = {
            "sequence_output": sequence_output,
            "pooled_output": pooled,
            "mlm_logits": mlm_logits,
            "nsp_logits": nsp_logits,
        }
        out.update(mlm_metrics(mlm_logits, masked_lm_ids, masked_lm_weights, self.config.mlm_loss_mode))
        out.update(nsp_metrics(nsp_logits, next_sentence_labels, next_sentence_weights))
        out["loss"] = out["mlm_loss"] + out["nsp_loss"]
        return out

    # ----- Hugging Face checkpoints -----------------------------------------------------
    @classmethod
    def from_pretrained(cls, folder, **overrides) -> PackedBertForPreTraining:
        """Read an HF BERT folder (config.json + model.safetensors or pytorch_model.bin,
        BertForPreTraining or a bare BertModel). Missing heads are initialised and
        reported in `loading_report` and the log. Overrides change non-shape options
        (dropout, attention_backend, ...); shape fields must match the checkpoint."""
        folder = Path(folder)
        config = read_config(folder, overrides)
        # pretraining may start from a bare encoder: its heads are then initialised (and logged)
        reference, info = load_reference("BertForPreTraining", folder, new_head=True, config=config)
        model = cls(config)
        state = reference.state_dict()
        state.pop("cls.predictions.decoder.bias", None)  # HF alias of cls.predictions.bias
        adopt_weights(model, state, info, folder, tied=("cls.predictions.decoder.weight",))
        return model

    def save_pretrained(self, folder) -> None:
        """Write a folder that transformers.BertForPreTraining.from_pretrained loads with no
        missing or unexpected keys (safetensors). Atomic: temporary folder, then rename."""
        reference = reference_model(hf_model_class("BertForPreTraining"), self.config)
        reference.load_state_dict(self.state_dict(), strict=False)
        reference.tie_weights()
        save_folder(reference, folder)

    # ----- pieces for pipeline stages ---------------------------------------------------
    @property
    def encoder_layers(self) -> nn.ModuleList:
        return self.bert.encoder.layer
