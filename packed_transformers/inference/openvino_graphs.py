"""Packed rows through OpenVINO (`runtime="openvino"`): what only fixed-shape packs allow on a
CPU. The packed model, its block-diagonal attention inside, is converted to an OpenVINO model
once (rows and width left open), then compiled once per row shape it meets (the Runner pads
each width's tables to one row count, so a run meets a few shapes, each compiled at its first
batch: its kernels and weight layouts chosen for that shape, which a padded batch of another
length each time never gets).

    graphs = OpenVinoGraphs(model, "int8", threads=2)
    graphs.calibrate([rows, ...])         # int8: packed rows of texts like the ones to come
    out = graphs(**batch)                 # {"embeddings": tensor [rows, K, D], ...}

float32: the converted model, asked for f32 (no bf16 or f16 the CPU plugin might pick).
int8: NNCF's post-training static quantization (model_type TRANSFORMER: matrix products with
int8 weights per channel and int8 activations at scales fixed by calibration, SmoothQuant and
bias correction; attention scores and softmax stay float) over packed rows of calibration
texts, the way sentence-transformers quantizes for OpenVINO through optimum-intel (which
calibrates on 300 sentences). Quality is measured, not assumed: docs/embeddings.md.

Refused in one line (`openvino_problem`) where openvino (or, for int8, nncf) is not installed,
on a device other than the CPU, or for bfloat16.
"""

from __future__ import annotations

import time

import numpy as np
import torch

CALIBRATION_TEXTS = 300  # texts an int8 graph is calibrated on where the caller gives none


def openvino_problem(device: str, dtype: str) -> str | None:
    """The one-line reason `runtime="openvino"` cannot run `dtype` on `device` here, or None."""
    if device != "cpu":
        return f"--runtime openvino runs on a CPU, not on {device}"
    if dtype not in ("float32", "int8"):
        return f"--runtime openvino runs float32 or int8, not {dtype}"
    try:
        import openvino  # noqa: F401
    except ImportError:
        return "--runtime openvino: the openvino package is not installed (pip install packed-transformers[openvino])"
    if dtype == "int8":
        try:
            import nncf  # noqa: F401
        except ImportError:
            return "--runtime openvino --dtype int8: the nncf package is not installed (pip install packed-transformers[openvino])"
    return None


class OpenVinoGraphs:
    """`model`'s packed forward through OpenVINO: called as the model is (keyword tensors of
    one batch of rows), answering its outputs as float32 tensors by name."""

    def __init__(self, model: torch.nn.Module, dtype: str, threads: int):
        self.model, self.dtype, self.threads = model.eval(), dtype, threads
        self.converted = None  # the openvino.Model, rows and width open (quantized once for int8)
        self.compiled: dict[tuple, tuple] = {}  # row shape -> (infer request, its output names)
        self.calibrated = dtype != "int8"
        self.setup_seconds = 0.0  # conversion, quantization and compilation, all shapes

    def _convert(self, batch: dict) -> None:
        import openvino

        started = time.perf_counter()
        with torch.inference_mode():
            self.converted = openvino.convert_model(
                self.model, example_input=batch, input=[openvino.PartialShape([-1, -1])] * len(batch)
            )
        self.input_names = list(batch)
        self.setup_seconds += time.perf_counter() - started

    def calibrate(self, batches: list[dict]) -> None:
        """int8: quantize the converted model on `batches` (rows as pack_rows makes them, numpy
        int64, any shapes). Once; a later call changes nothing."""
        if self.calibrated:
            return
        import nncf

        if not batches:
            raise ValueError("--dtype int8 with --runtime openvino: no calibration rows")
        if self.converted is None:
            self._convert({name: torch.from_numpy(value) for name, value in batches[0].items()})
        started = time.perf_counter()
        feeds = [[batch[name] for name in self.input_names] for batch in batches]
        self.converted = nncf.quantize(
            self.converted, nncf.Dataset(feeds), model_type=nncf.ModelType.TRANSFORMER, subset_size=len(feeds)
        )
        self.calibrated = True
        self.setup_seconds += time.perf_counter() - started

    def __call__(self, **batch) -> dict:
        if not self.calibrated:
            raise RuntimeError(
                "OpenVinoGraphs: int8 graphs are calibrated (calibrate) before their first batch"
            )
        if self.converted is None:
            self._convert(batch)
        shape = tuple(tuple(batch[name].shape) for name in self.input_names)
        if shape not in self.compiled:
            self._compile(shape)
        request, outputs = self.compiled[shape]
        answer = request.infer([batch[name].numpy() for name in self.input_names])
        return {name: torch.from_numpy(np.array(answer[port])) for name, port in outputs.items()}

    def _compile(self, shape: tuple) -> None:
        import openvino

        started = time.perf_counter()
        model = self.converted.clone()
        model.reshape({port: openvino.PartialShape(list(dims)) for port, dims in zip(model.inputs, shape)})
        settings = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": self.threads}
        compiled = openvino.Core().compile_model(model, "CPU", settings)
        # the model's outputs by the names its forward gives them (the dict keys)
        outputs = {}
        for port in compiled.outputs:
            names = port.get_names()
            named = sorted(n for n in names if not n.isdigit())
            outputs[named[0] if named else port.get_any_name()] = port
        self.compiled[shape] = (compiled.create_infer_request(), outputs)
        self.setup_seconds += time.perf_counter() - started
