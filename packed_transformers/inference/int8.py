"""int8 inference on a CPU: the encoder layers' matrix products in int8, through torch's own
x86 kernels (fbgemm's dynamic quantized linear), everything else as in float32.

    problem = int8_problem("cpu")        # None, or the one line that refuses it here
    model8 = quantize_encoder(model)     # a copy; `model` is left as it was

What is quantized, and how (docs/embeddings.md has the measurements behind each choice):
- every nn.Linear inside the transformer's layers (`INT8_LAYERS`: query, key, value, the
  attention's output, the feed-forward's two): weights int8, symmetric, one scale per output
  channel, fixed at load; activations uint8 with a scale and zero point per forward (dynamic,
  per tensor, the whole 0..255 range);
- the heads (pooler, classifier, QA and token heads), embeddings, LayerNorm, softmax, the
  packed attention's block-diagonal mask and the pooling stay float32: they are a small part
  of the time, and a head in int8 moves labels for nothing.

Why the whole 0..255 range, and so a CPU with VNNI (AVX512-VNNI, AVX-VNNI or AMX): torch's
own quantized Linear asks fbgemm for 7-bit activations (`reduce_range=True`), because on a
CPU without VNNI the u8 x s8 products are summed in pairs into int16 (vpmaddubsw), which
saturates with full-range inputs. Measured on MiniLM-L6 (1,000 BBC texts): 7-bit activations
give a per-text cosine to float32 of min 0.945 / median 0.976, under ONNX Runtime int8's
0.983 / 0.993 (the quality gate: no worse than the int8 peer); 8-bit give 0.983 / 0.993.
VNNI sums u8 x s8 into int32 directly, so 8 bits are exact there; without it int8 is refused.

torch marks its quantized-tensor API deprecated (pytorch issue 184982); the pinned torch
(2.13.0) has it, and an upgrade must re-run tests/inference/test_int8.py.
"""

from __future__ import annotations

import copy
import warnings

import torch

# Names of the Linear modules that are quantized: those under a transformer layer (BERT's
# `encoder.layer.N.`); the heads are never under one.
INT8_LAYERS = ".layer."
INT8_WEIGHT_MAX = 127  # symmetric int8 weights in [-127, 127]: a negated weight stays exact


def int8_problem(device: str) -> str | None:
    """The one-line reason int8 cannot run on `device` here, or None."""
    if device != "cpu":
        return f"--dtype int8 runs on a CPU (torch's x86 int8 kernels), not on {device}"
    if "fbgemm" not in torch.backends.quantized.supported_engines and "x86" not in (
        torch.backends.quantized.supported_engines
    ):
        return "--dtype int8: this torch build has no x86 int8 kernels (fbgemm)"
    if not (torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported()):
        from packed_transformers.inference.runtime_choice import INT8_WITHOUT_VNNI

        return INT8_WITHOUT_VNNI
    return None


class Int8Linear(torch.nn.Module):
    """nn.Linear's forward with its weight in int8 (per output channel) and its input quantized
    to uint8 per call: x [..., in_features] float32 -> [..., out_features] float32."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1) / INT8_WEIGHT_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        bias = None if linear.bias is None else linear.bias.detach().float()
        with warnings.catch_warnings():  # the deprecation said in the module's docstring
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reduce_range=False: 8-bit activations, exact on VNNI (see the module's docstring)
        return torch.ops.quantized.linear_dynamic(x.float(), self._packed, False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


def quantize_encoder(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` (eval mode, on the CPU) whose transformer layers' Linear modules are
    Int8Linear; raises ValueError (one line) where int8_problem says so, or where the model
    has no Linear under a transformer layer."""
    problem = int8_problem("cpu")
    if problem:
        raise ValueError(problem)
    quantized = copy.deepcopy(model).cpu().eval()
    targets = [
        name
        for name, module in quantized.named_modules()
        if isinstance(module, torch.nn.Linear) and INT8_LAYERS in f".{name}."
    ]
    if not targets:
        raise ValueError(f"--dtype int8: {type(model).__name__} has no Linear under a transformer layer")
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = quantized.get_submodule(parent_name)
        setattr(parent, child, Int8Linear(getattr(parent, child)))
    return quantized
