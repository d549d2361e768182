"""The dtype inference runs in: float32, bfloat16 where the device computes it natively, or
int8 on a CPU with VNNI (inference.int8: the transformer layers' matrix products in int8).

    problem = device_problem("cpu", "bfloat16")   # None, or the one line that refuses it
    with precision("cpu", "bfloat16"):             # the forward passes under bf16 autocast
        logits = model(**batch)["logits"]

bfloat16 runs the forward under torch.autocast: matrix products in bf16, LayerNorm,
softmax and the heads' reductions in float32 (autocast's own lists), the weights kept in
float32. A bf16 copy of the weights was measured against it (docs/embeddings.md): it
also rounds LayerNorm and the residual stream, for no speed gained on CPU.

On a CPU without bf16 instructions (AVX512-BF16 or AMX) torch emulates bf16 through
float32 conversions: slower than float32 and less exact, so it is refused with a line
saying why rather than run.
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = ("float32", "bfloat16", "int8")


def native_bf16(device: str) -> bool:
    """Whether `device` ("cpu" | "cuda") computes bf16 matrix products in hardware."""
    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def device_problem(device: str, dtype: str = "float32") -> str | None:
    """The one-line reason `device` / `dtype` cannot run here, or None."""
    if device not in ("cpu", "cuda"):
        return f"--device must be cpu or cuda, got {device!r}"
    if dtype not in DTYPES:
        return f"--dtype must be one of {DTYPES}, got {dtype!r}"
    if device == "cuda" and not torch.cuda.is_available():
        from packed_transformers.common.cli import no_gpu

        return no_gpu("--device cuda", torch.__version__, torch.version.cuda is not None)
    if dtype == "int8":
        from packed_transformers.inference.int8 import int8_problem

        return int8_problem(device)
    if dtype == "bfloat16" and not native_bf16(device):
        if device == "cpu":
            from packed_transformers.inference.runtime_choice import BF16_WITHOUT_INSTRUCTIONS

            return BF16_WITHOUT_INSTRUCTIONS
        return "--dtype bfloat16: this GPU has no bf16; bf16 would be emulated, slower than float32 (use --dtype float32)"
    return None


def precision(device: str, dtype: str):
    """A context in which forward passes run in `dtype` (see the module's docstring); int8 is
    in the model itself (inference.int8.quantize_encoder), so its context is float32's."""
    if dtype in ("float32", "int8"):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=torch.bfloat16)
