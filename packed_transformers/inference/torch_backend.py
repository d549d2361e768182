"""The packed model in torch as a Backend (inference.backend): numpy rows to the device, the
forward in eval mode under the dtype's precision, numpy outputs back.

    backend = TorchBackend(model, torch.device("cpu"), "int8", compiled=False)
    out = backend(rows, ("embeddings",))          # {"embeddings": float32 [rows, K, D]}

float32; bfloat16 under autocast where the device computes it (inference.precision); int8 on a
CPU with VNNI: a quantized copy of the model (inference.int8), so the loaded float32 model
still serves other runners. compiled: torch.compile per row shape (`compiled_forward`), so
the Runner pads each width's tables to one shape (`fixed_shapes`).
"""

from __future__ import annotations

import torch

from packed_transformers.inference.backend import Backend, ExtraInputs, Read

# What a compiled backend hands torch.compile (tests count graphs through another backend).
COMPILE_BACKEND = "inductor"


class TorchBackend(Backend):
    runtime = "torch"  # its int8 is dynamic: nothing to calibrate (Backend's default)

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: str, compiled: bool):
        self.device, self.dtype, self.fixed_shapes = device, dtype, compiled
        self.model = model.to(device).eval()
        if dtype == "int8":
            from packed_transformers.inference.int8 import quantize_encoder

            self.model = quantize_encoder(self.model)
        self.forward_model = compiled_forward(self.model) if compiled else self.model

    def __call__(
        self,
        rows: dict,
        outputs: tuple[str, ...],
        read: Read | None = None,
        inputs: ExtraInputs | None = None,
    ) -> dict:
        from packed_transformers.inference.precision import precision

        batch = {
            name: torch.from_numpy(value).to(self.device, non_blocking=True) for name, value in rows.items()
        }
        if inputs is not None:
            batch.update(inputs(batch))
        with torch.inference_mode(), precision(self.device.type, self.dtype):
            out = self.forward_model(**batch)
            if read is not None:
                return read(batch, out)  # numpy: waits for the device too
            return {name: out[name].float().cpu().numpy() for name in outputs}  # .cpu() waits for the device


def compiled_forward(model):
    """`model` under torch.compile for inference: static shapes (dynamic=False) and, with
    inductor, its weights frozen into the graph (constant-folded, pre-packed for oneDNN on a
    CPU). Built at the first forward of each shape; bench/bench_compile.py times it."""
    import torch

    if COMPILE_BACKEND == "inductor":
        return torch.compile(model, dynamic=False, options={"freezing": True})
    return torch.compile(model, dynamic=False, backend=COMPILE_BACKEND)
