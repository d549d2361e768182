"""The module PopTorch compiles for training and evaluation, and its host-side inputs.

Pure torch (no poptorch import): the same module runs on CPU, which is how the tests
check that the IPU graph computes what the torch path's `train_step` computes.

A compiled graph cannot divide by the step's global masked-token count (it sees one
micro-batch at a time), so the host passes the step's normalisers as per-row inputs
(`mlm_scale`, `nsp_scale`: the same value on every row of a step), and the graph's loss
is components.step.micro_batch_loss (the torch engines' own) times N = GA x replicas, with
gradient accumulation and replication reduced by MEAN (running): the mean over the step's N
micro-batches of N x its share is exactly the torch path's loss, token losses / global
masked tokens + NSP losses / global sequences. Mean, not Sum: PopTorch's fp16 gradient
accumulators then hold one micro-batch's gradient size, not N of them summed (Graphcore's
BERT reduces by Mean with the Running strategy).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from packed_transformers.components.observe import SUM_KEYS
from packed_transformers.components.step import loss_scales, micro_batch_loss
from packed_transformers.model.encoder import encode_rows
from packed_transformers.model.pretraining import HEAD_INPUTS

# Fields the graph takes; source_index (int64 bookkeeping) stays on the host.
GRAPH_FIELDS = ("input_ids", "segment_ids", "position_ids", "sequence_ids", *HEAD_INPUTS)


class OneHotGather(nn.Module):
    """model.encoder.PositionGather as a matmul: one_hot(positions) [B, P, S] @ hidden
    [B, S, H]. The same numbers (each row sums exactly one hidden row); Graphcore's BERT
    gathers this way on IPUs, where a matmul maps onto the tiles better than a dynamic
    gather and its gradient is a matmul rather than a scatter-add (modeling.py,
    OnehotGather). The one-hot matrix takes the hidden dtype (fp16 under ipu.half)."""

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        one_hot = F.one_hot(positions.long(), hidden.shape[1]).to(hidden.dtype)
        return torch.matmul(one_hot.detach(), hidden)


def split_matmul(lhs: torch.Tensor, rhs: torch.Tensor, factor: int) -> torch.Tensor:
    """lhs [..., H] @ rhs [H, V] computed as `factor` matmuls over slices of V, concatenated:
    what poptorch.serializedMatMul(lhs, rhs, OutputChannels, factor) computes (the CPU
    stand-in; the IPU backend passes PopTorch's own)."""
    return torch.cat([lhs @ part for part in rhs.chunk(factor, dim=1)], dim=-1)


class SerializedProjection(nn.Module):
    """model.heads.TiedProjection with the [H] x [V] decoder matmul split into `factor`
    matmuls over the vocabulary (output channels), as Graphcore's BERT-Large does
    (embedding_serialization_factor 2, modeling.py SerializedLinear): the full [rows, V]
    product and its gradient never exist at once on IPU 0. No parameters: the tied weight
    is still the word embeddings'.

    matmul(lhs, rhs, factor): poptorch.serializedMatMul with OutputChannels on IPUs,
    `split_matmul` on CPU."""

    def __init__(self, factor: int, matmul: Callable = split_matmul):
        super().__init__()
        self.factor = factor
        self.matmul = matmul

    def forward(self, hidden, weight, bias):
        return self.matmul(hidden, weight.t(), self.factor) + bias


def adapt_for_ipu(model, serialization_factor: int, onehot_gather: bool, matmul: Callable = split_matmul):
    """Put the IPU kernels into a PackedBertForPreTraining in place (state dict unchanged):
    one-hot gathers for the masked positions and the pooler's [CLS] rows, and the
    serialized MLM decoder when `serialization_factor` > 1. Returns the model."""
    if onehot_gather:
        model.mlm_gather = OneHotGather()
        model.bert.pooler.gather = OneHotGather()
    if serialization_factor > 1:
        model.cls.predictions.project = SerializedProjection(serialization_factor, matmul)
    return model


class HeadsBlock(nn.Module):
    """The pooler and the pretraining heads as one callable block, so that one
    poptorch.BeginBlock places all of them (Graphcore: on IPU 0, next to the tied
    word embeddings). Holds no parameters of its own: it calls the model's `heads`."""

    def __init__(self, model):
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a submodule: no duplicate weights

    def forward(self, sequence_output, *head_inputs):
        return self._model.heads(sequence_output, *head_inputs)


class PretrainingStep(nn.Module):
    """(graph fields + mlm_scale + nsp_scale) -> (loss, sums [1, len(SUM_KEYS)] float32).

    `loss_marker` marks the loss for the compiler: poptorch.identity_loss(x, "none") on
    IPUs, the identity on CPU. Sums follow components.observe.SUM_KEYS."""

    def __init__(self, model, loss_marker: Callable[[torch.Tensor], torch.Tensor] = lambda x: x):
        super().__init__()
        self.model = model
        self.heads = HeadsBlock(model)
        self.loss_marker = loss_marker

    # fmt: off
    def forward(self, input_ids, segment_ids, position_ids, sequence_ids,               # [B, S]
                masked_lm_positions, masked_lm_ids, masked_lm_weights,                  # [B, M]
                next_sentence_positions, next_sentence_labels, next_sentence_weights,   # [B, K]
                mlm_scale, nsp_scale):                                                  # [B]
        # fmt: on
        # PopTorch matches the graph's inputs to these named positional arguments.
        sequence_output = encode_rows(
            self.model.bert, input_ids, segment_ids, position_ids, sequence_ids, None
        )
        head_inputs = [masked_lm_positions, masked_lm_ids, masked_lm_weights]
        head_inputs += [next_sentence_positions, next_sentence_labels, next_sentence_weights]
        out = self.heads(sequence_output, *head_inputs)
        out["tokens"] = (sequence_ids > 0).sum()
        # Every row of a step carries the same scale; row 0 stands for the micro-batch.
        loss = micro_batch_loss(out["mlm_loss_sum"], out["nsp_loss_sum"], mlm_scale[0], nsp_scale[0])
        sums = torch.stack([out[key].float() for key in SUM_KEYS]).unsqueeze(0)
        return self.loss_marker(loss), sums


def step_inputs(
    micro_batches: list[dict], steps: int, step_counts: list[torch.Tensor], mean_over: int = 1
) -> dict:
    """A host call's micro-batches -> one combined batch of GRAPH_FIELDS + scales.

    micro_batches: `steps` consecutive groups (one per optimizer step: device iterations
    are the outermost dimension of PopTorch's combined batch), each of [B, ...] dicts.
    step_counts[i]: the global [masked tokens, sequences] of step i. mean_over: the N the
    training graph's Mean reduction divides by (GA x replicas); the scales are multiplied
    by it (1 for evaluation, whose scales are unused)."""
    per_step = len(micro_batches) // steps
    if per_step * steps != len(micro_batches) or len(step_counts) != steps:
        raise ValueError(
            f"{len(micro_batches)} micro-batches do not split into {steps} steps with {len(step_counts)} counts"
        )
    combined = {name: torch.cat([b[name] for b in micro_batches]) for name in GRAPH_FIELDS}
    rows = [b["input_ids"].shape[0] * per_step for b in micro_batches[::per_step]]
    scales = [[value * mean_over for value in loss_scales(c)] for c in step_counts]
    mlm = torch.cat([torch.full((r,), scale[0]) for r, scale in zip(rows, scales)])
    nsp = torch.cat([torch.full((r,), scale[1]) for r, scale in zip(rows, scales)])
    combined["mlm_scale"], combined["nsp_scale"] = mlm, nsp
    return combined
