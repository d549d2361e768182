"""BERT embeddings and encoder for packs. Parameter names mirror Hugging Face's BertModel
(`embeddings.*`, `encoder.layer.N.*`, `pooler.*`) so weights move over by name."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

from packed_transformers.model.attention import PackedSelfAttention, build_mask, rows_mask
from packed_transformers.model.layers import Dropout, activation


class Embeddings(nn.Module):
    """word + position (restarting at 0 in every packed sequence) + segment, LayerNorm."""

    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(
            config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id
        )
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, position_ids, segment_ids):
        """[B, S] integer ids each -> [B, S, H]."""
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(position_ids)
            + self.token_type_embeddings(segment_ids)
        )
        return self.dropout(self.LayerNorm(x))


class _Output(nn.Module):
    """dense -> dropout -> residual -> LayerNorm (HF's BertSelfOutput / BertOutput)."""

    def __init__(self, config, in_size):
        super().__init__()
        self.dense = nn.Linear(in_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, x, residual):
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class _Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = PackedSelfAttention(config)
        self.output = _Output(config, config.hidden_size)

    def forward(self, hidden, mask):
        return self.output(self.self(hidden, mask), hidden)

    def forward_rows(self, hidden, rows, row_mask):
        """Queries (and the residual) at `rows` [B, R, H] only -> [B, R, H]."""
        return self.output(self.self.forward_rows(hidden, rows, row_mask), rows)


class _Intermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act)

    def forward(self, x):
        return self.act(self.dense(x))


class EncoderLayer(nn.Module):
    """One transformer layer; `recompute` trades compute for activation memory."""

    def __init__(self, config):
        super().__init__()
        self.attention = _Attention(config)
        self.intermediate = _Intermediate(config)
        self.output = _Output(config, config.intermediate_size)
        self.recompute = bool(getattr(config, "recompute_layers", False))

    def _forward(self, hidden, mask):
        attended = self.attention(hidden, mask)
        return self.output(self.intermediate(attended), attended)

    def forward(self, hidden, mask):
        """hidden [B, S, H], mask from model.attention.build_mask -> [B, S, H]."""
        if self.recompute and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, hidden, mask, use_reentrant=False)
        return self._forward(hidden, mask)

    def forward_rows(self, hidden, positions, row_mask):
        """The layer's output at `positions` [B, R] only -> [B, R, H]: keys and values from
        every token, but queries, the attention output, the residual and the feed-forward
        block only where they are read. Exactly those rows of `forward`."""
        rows = gather_positions(hidden, positions)
        attended = self.attention.forward_rows(hidden, rows, row_mask)
        return self.output(self.intermediate(attended), attended)


class Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden, mask, rows=None):
        """hidden [B, S, H] -> [B, S, H]; with `rows` = (positions [B, R], row mask), the last
        layer runs at those positions only and the result is [B, R, H]."""
        last = len(self.layer) - 1 if rows is not None else len(self.layer)
        for layer in self.layer[:last]:
            hidden = layer(hidden, mask)
        if rows is not None:
            hidden = self.layer[-1].forward_rows(hidden, *rows)
        return hidden


class Pooler(nn.Module):
    """tanh(dense(h)) of each sequence's [CLS] token, gathered by position."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()
        self.gather = PositionGather()

    def forward(self, sequence_output, cls_positions):
        """sequence_output [B, S, H], cls_positions [B, K] -> [B, K, H]."""
        return self.pool(self.gather(sequence_output, cls_positions))

    def pool(self, cls_hidden):
        """[CLS] hidden states already gathered, [B, K, H] -> [B, K, H]."""
        return self.activation(self.dense(cls_hidden))


def gather_positions(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """hidden [B, S, H], positions [B, P] (int) -> hidden at those positions, [B, P, H]."""
    index = positions.long()[:, :, None].expand(-1, -1, hidden.shape[-1])
    return torch.gather(hidden, 1, index)


class PositionGather(nn.Module):
    """`gather_positions` as a module without parameters: the one place where rows of the
    sequence output are picked ([CLS] for the pooler, masked positions for MLM), so that a
    backend can put in an equivalent of its own (the IPU backend's one-hot matmul) without
    the model knowing about it. The state dict is unchanged."""

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return gather_positions(hidden, positions)


class PackedBertModel(nn.Module):
    """Embeddings + encoder (+ pooler used by the heads). Exposes the pieces for stages.
    add_pooling_layer=False: no pooler (question answering reads every token, and
    Hugging Face's BertForQuestionAnswering checkpoints have no pooler weights)."""

    def __init__(self, config, add_pooling_layer: bool = True):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.pooler = Pooler(config) if add_pooling_layer else None

    def attention_mask(self, sequence_ids, dtype, slots: int | None = None):
        return build_mask(self.config.attention_backend, sequence_ids, dtype, slots)

    def forward(
        self,
        input_ids,
        position_ids,
        segment_ids,
        sequence_ids,
        slots: int | None = None,
        read_positions=None,
    ):
        """[B, S] ids -> sequence_output [B, S, H]. slots: K sequences per pack (the width
        of the batch's [B, K] fields), which the varlen backend needs as a static number.
        read_positions [B, R]: the only positions the caller reads (a classifier's [CLS]);
        the last layer then computes those rows only and the output is [B, R, H]."""
        hidden = self.embeddings(input_ids.long(), position_ids.long(), segment_ids.long())
        mask = self.attention_mask(sequence_ids, hidden.dtype, slots)
        rows = None if read_positions is None else (read_positions, rows_mask(sequence_ids, read_positions))
        return self.encoder(hidden, mask, rows)


def encode_rows(
    bert: PackedBertModel, input_ids, segment_ids, position_ids, sequence_ids, slots, read_positions=None
):
    """The packed encoder's call, in the packed fields' order: [B, S] ids -> hidden [B, S, H]
    (or [B, R, H] at `read_positions` [B, R] only: the last layer then computes just those
    rows). `slots`: K, or a [B, K] tensor whose width is K (the varlen backend needs K as a
    static number)."""
    if isinstance(slots, torch.Tensor):
        slots = slots.shape[1]
    return bert(input_ids, position_ids, segment_ids, sequence_ids, slots, read_positions=read_positions)


def slot_masks(sequence_ids, slots: int) -> torch.Tensor:
    """sequence_ids [B, S] -> bool [B, K, S]: token s belongs to the sequence in slot k.
    The per-sequence read-out of every head that reads more than one token per sequence
    (QA's per-window softmax, pooled embeddings)."""
    numbers = torch.arange(1, slots + 1, device=sequence_ids.device)
    return sequence_ids[:, None, :] == numbers[None, :, None]
