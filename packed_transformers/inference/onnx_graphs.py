"""Packed rows through ONNX Runtime (`runtime="onnxruntime"`): the packed model, its
block-diagonal attention and per-sequence read-out inside, exported once to ONNX with rows,
width and slots open, run by inference.onnx_session.

    graphs = OnnxGraphs(model, "int8", threads=2)
    out = graphs(rows, ("embeddings",))    # numpy rows in: {"embeddings": float32 [rows, K, D]}
    export_graph(model, rows, "int8", path)   # the file `packed export` writes

float32: torch.onnx.export's TorchScript exporter (opset 17), ONNX Runtime's graph
optimizations at load. int8: ONNX Runtime's dynamic quantization of that graph (int8 weights
per output channel, activations quantized per tensor at run time; the kind of int8 the 40-line
ONNX Runtime peer runs, docs/embeddings.md), which needs no calibration, so nothing about
it depends on which texts came first (OpenVINO's static int8 does; issue 93).

The exported graph is kept in the graph cache (inference.graph_cache:
`$PACKED_TRANSFORMERS_CACHE/onnxruntime/<key>/model.onnx`), keyed by the weights' bytes, the
config, the model room's sources, the dtype and the torch, onnx and onnxruntime versions; a
cache that cannot be written costs one warning line and the graph is run from memory.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from packed_transformers.inference import graph_cache
from packed_transformers.inference.backend import Backend, graph_reads_whole
from packed_transformers.inference.onnx_session import RUNTIME, OnnxSession
from packed_transformers.model.attention import PackedSelfAttention

OPSET = 17  # LayerNormalization as one op
# the axes left open, by row field: [rows, width] token fields, [rows, slots] slot fields
SLOT_FIELDS = ("cls_positions", "example_index")
GRAPH_FILE = "model.onnx"


def float_outputs(model: torch.nn.Module, batch: dict) -> list[str]:
    """The model's floating-point outputs for `batch` (its scores or vectors: what a graph
    returns; masks and indices are the rows' own)."""
    with torch.inference_mode():
        out = model(**batch)
    return [name for name, value in out.items() if torch.is_tensor(value) and value.is_floating_point()]


@contextlib.contextmanager
def dense_attention(model: torch.nn.Module):
    """The block-diagonal attention exported as the dense backend (model.attention): one
    additive float mask built per batch, added to every layer's scores. SDPA's boolean mask
    exports as a Where and an IsNaN guard over [rows, heads, width, width] in every layer,
    measured at 18% of the float32 graph's time (docs/embeddings.md); the outputs are the
    same. Put back after."""
    config = getattr(model, "config", None)
    attentions = [m for m in model.modules() if isinstance(m, PackedSelfAttention) and m.backend == "sdpa"]
    before = getattr(config, "attention_backend", None)
    switch = before == "sdpa" and len(attentions) > 0
    if switch:
        config.attention_backend = "dense"
        for module in attentions:
            module.backend = "dense"
    try:
        yield
    finally:
        if switch:
            config.attention_backend = before
            for module in attentions:
                module.backend = before


def export_graph(model: torch.nn.Module, rows: dict, dtype: str, path: Path) -> list[str]:
    """Write `model`'s packed forward to `path` as ONNX (float32, or int8 by dynamic
    quantization), traced on `rows` (pack_rows' int64 arrays; any shape: the axes are left
    open). -> the graph's output names."""
    names = list(rows)
    batch = {name: torch.from_numpy(np.ascontiguousarray(rows[name])) for name in names}
    outputs = float_outputs(model, batch)

    class Positional(torch.nn.Module):  # the exporter passes inputs by position
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *tensors):
            out = self.model(**dict(zip(names, tensors)))
            return tuple(out[name] for name in outputs)

    axes = {name: {0: "rows", 1: "slots" if name in SLOT_FIELDS else "width"} for name in names}
    axes.update({name: {0: "rows", 1: "slots"} for name in outputs})
    with tempfile.TemporaryDirectory(prefix="packed-onnx-") as scratch:
        fp32 = Path(scratch) / "fp32.onnx" if dtype == "int8" else path
        # the TorchScript exporter (dynamo=False) warns that it is deprecated; the dynamo one
        # needs onnxscript, which the install does not carry (not tried here)
        with torch.inference_mode(), dense_attention(model), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(
                Positional().eval(), tuple(batch[name] for name in names), str(fp32), input_names=names,
                output_names=outputs, dynamic_axes=axes, opset_version=OPSET, dynamo=False,
            )  # fmt: skip
        if dtype == "int8":
            quantize_int8(fp32, path)
    return outputs


def quantize_int8(fp32: Path, int8: Path) -> None:
    """ONNX Runtime's dynamic quantization: the matrix products' weights int8 per output
    channel (signed), activations quantized per tensor at run time."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # its advice to pre-process the graph is a warning on the root logger at every quantization
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        # DefaultTensorType: where the quantizer's shape inference cannot type a tensor, float32
        quantize_dynamic(str(fp32), str(int8), per_channel=True, weight_type=QuantType.QInt8,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})  # fmt: skip
    finally:
        root.setLevel(level)


def graph_key(model: torch.nn.Module, dtype: str, names: list[str]) -> str:
    versions = "|".join(f"{p} {importlib.metadata.version(p)}" for p in ("torch", "onnx", "onnxruntime"))
    digest = graph_cache.model_digest(model, f"{dtype}|{versions}|opset {OPSET}")
    digest.update("|".join(names).encode())
    return f"{dtype}-{digest.hexdigest()[:32]}"


class OnnxGraphs(Backend):
    """`model`'s packed forward through ONNX Runtime, a Backend (inference.backend): numpy rows
    in, float32 numpy outputs by name. The graph, rows and width open, is exported (or read
    from the cache) at the first batch."""

    runtime = "onnxruntime"
    # dynamic int8: nothing to calibrate (Backend's default)
    fixed_shapes = False  # one graph with rows and width open

    def __init__(self, model: torch.nn.Module, dtype: str, threads: int):
        self.model, self.dtype, self.threads = model.eval(), dtype, threads
        self.session: OnnxSession | None = None
        self.from_cache = False
        self.setup_seconds = 0.0  # export (and quantization) or the cache read, and the session

    def _build(self, rows: dict) -> None:
        started = time.perf_counter()
        names = list(rows)
        key = graph_key(self.model, self.dtype, names)
        cached = graph_cache.cached_file(RUNTIME, key, GRAPH_FILE)
        self.from_cache = cached is not None
        if cached is not None:
            try:
                self.session = OnnxSession(cached, self.threads)
            except Exception:  # noqa: BLE001 - a damaged entry: built again below
                graph_cache.discard(RUNTIME, key)
                self.from_cache = False
        if self.session is None:
            with tempfile.TemporaryDirectory(prefix="packed-onnx-") as scratch:
                path = Path(scratch) / GRAPH_FILE
                export_graph(self.model, rows, self.dtype, path)
                graph = path.read_bytes()
            graph_cache.keep(RUNTIME, key, lambda folder: (folder / GRAPH_FILE).write_bytes(graph))
            self.session = OnnxSession(graph, self.threads)
        self.setup_seconds += time.perf_counter() - started

    def __call__(self, rows: dict, outputs: tuple[str, ...], read=None, inputs=None) -> dict:
        """Backend's call: numpy rows in, numpy outputs out (the graph exported at the first)."""
        graph_reads_whole(read, inputs)
        if self.session is None:
            self._build(rows)
        answer = self.session(rows)
        return {name: answer[name] for name in outputs}
