"""Pretraining heads and losses for packs: MLM on gathered masked positions, NSP per
sequence through its [CLS] position. Every metric is returned as a sum and a count so
that accumulation steps and replicas combine exactly (never a mean of means)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from packed_transformers.model.layers import activation


class _Transform(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform_act_fn = activation(config.hidden_act)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x):
        return self.LayerNorm(self.transform_act_fn(self.dense(x)))


class TiedProjection(nn.Module):
    """hidden [..., H] @ weight[V, H].T + bias [V] -> [..., V], holding no parameters (the
    weight is the word embeddings', passed in), so that a backend can put in an equivalent
    of its own (the IPU backend's serialized matmul) without changing the state dict."""

    def forward(self, hidden, weight, bias):
        # One fused matmul + bias (addmm): a separate `+ bias` is one more pass over the
        # [B, M, V] logits, the largest tensor of a small model's step.
        return F.linear(hidden, weight, bias)


class MlmHead(nn.Module):
    """HF's BertLMPredictionHead: transform, then a decoder tied to the word embeddings."""

    def __init__(self, config):
        super().__init__()
        self.transform = _Transform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.project = TiedProjection()

    def forward(self, masked_hidden):
        """[B, M, H] -> logits [B, M, V]."""
        return self.project(self.transform(masked_hidden), self.decoder.weight, self.bias)


class PretrainingHeads(nn.Module):
    """Named `cls` in the model, with HF's sub-names (predictions, seq_relationship)."""

    def __init__(self, config):
        super().__init__()
        self.predictions = MlmHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


def mlm_metrics(mlm_logits, masked_lm_ids, masked_lm_weights, mode: str) -> dict:
    """mlm_logits [B, M, V]; masked_lm_ids [B, M]; masked_lm_weights [B, M] = index j
    (1..K) of the sequence a masked token belongs to, 0 for unused slots.

    per_token (MLPerf): loss = sum of token losses / number of masked tokens.
    per_sequence: mean loss of each sequence's masked tokens, averaged over sequences.
    """
    valid = masked_lm_weights > 0
    labels = masked_lm_ids.long()
    # fp16 logits (the IPU's half precision) stay fp16, as in Graphcore's BERT (modeling.py):
    # an fp32 copy of the [B*M, V] logits is tens of MB of temporaries on IPU 0, the fullest
    # IPU. Other dtypes (bf16 autocast, fp32) go through fp32. The per-token losses are fp32.
    logits = mlm_logits if mlm_logits.dtype == torch.float16 else mlm_logits.float()
    token_loss = (
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").float().view_as(labels)
        * valid
    )
    count = valid.sum()
    out = {
        "mlm_loss_sum": token_loss.sum(),
        "mlm_count": count,
        "mlm_correct": ((mlm_logits.argmax(-1) == labels) & valid).sum(),
    }
    # Per-sequence sums: slot j of [B, K+1] gathers the tokens of sequence j (0 = unused).
    if mode == "per_sequence":
        index = masked_lm_weights.long()
        k_plus_1 = int(masked_lm_weights.max().item()) + 1
        seq_sum = torch.zeros(labels.shape[0], k_plus_1, device=labels.device).scatter_add_(
            1, index, token_loss
        )
        seq_count = torch.zeros_like(seq_sum).scatter_add_(1, index, valid.float())
        seq_sum, seq_count = seq_sum[:, 1:], seq_count[:, 1:]
        has_tokens = seq_count > 0
        out["mlm_sequence_loss_sum"] = (seq_sum / seq_count.clamp(min=1) * has_tokens).sum()
        out["mlm_sequence_count"] = has_tokens.sum()
        out["mlm_loss"] = out["mlm_sequence_loss_sum"] / out["mlm_sequence_count"].clamp(min=1)
    else:
        out["mlm_loss"] = out["mlm_loss_sum"] / count.clamp(min=1)
    return out


def nsp_metrics(nsp_logits, next_sentence_labels, next_sentence_weights) -> dict:
    """nsp_logits [B, K, 2]; labels and weights [B, K] (weight 1 = sequence present)."""
    valid = next_sentence_weights > 0
    labels = next_sentence_labels.long()
    loss = F.cross_entropy(nsp_logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    loss = loss.view_as(labels) * valid
    count = valid.sum()
    return {
        "nsp_loss_sum": loss.sum(),
        "nsp_count": count,
        "nsp_correct": ((nsp_logits.argmax(-1) == labels) & valid).sum(),
        "nsp_loss": loss.sum() / count.clamp(min=1),
    }
