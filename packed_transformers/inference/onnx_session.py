"""A packed graph run by ONNX Runtime: packed rows (numpy, as packs.rows.pack_rows makes
them) in, the model's outputs (numpy float32, by name) out. No torch: the exported folder's
torch-free process (door.exported_folder) and the `--runtime onnxruntime` Runner
(inference.onnx_graphs) both run their graphs here.

    session = OnnxSession(Path("model.onnx"), threads=2)
    outputs = session(rows)          # {"embeddings": [rows, K, D]} or {"logits": [rows, K, C]}

Rows and width are open in the graph (one graph for every row shape: nothing compiled per
shape, so a server's batches of any size cost no compile, unlike OpenVINO's). The session runs
ONNX Runtime's full graph optimizations (LayerNorm, GELU, bias and skip fusions) on the CPU,
`threads` intra-op threads and one inter-op thread, as a sentence-transformers user's ONNX
session does.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from packed_transformers.common.install_advice import pip_install
from packed_transformers.common.telemetry import decline_onnxruntime_telemetry

# before onnxruntime is first imported: its wheel sends usage telemetry by default (common.telemetry)
decline_onnxruntime_telemetry()

RUNTIME = "onnxruntime"
GRAPH_DTYPES = ("float32", "int8")


def onnxruntime_problem(device: str, dtype: str) -> str | None:
    """The one-line reason `--runtime onnxruntime` cannot run `dtype` on `device`, or None."""
    if device != "cpu":
        return f"--runtime onnxruntime runs on a CPU, not on {device}"
    if dtype not in GRAPH_DTYPES:
        return f"--runtime onnxruntime runs float32 or int8, not {dtype}"
    if importlib.util.find_spec("onnxruntime") is None:
        return (
            f"--runtime onnxruntime: the onnxruntime package is not installed ({pip_install('onnxruntime')})"
        )
    return None


class OnnxSession:
    """One ONNX Runtime session of a packed graph (a file path or the graph's bytes)."""

    def __init__(self, graph: Path | bytes, threads: int):
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = max(1, int(threads))
        options.inter_op_num_threads = 1
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3  # errors only: its warnings are about fusions it skipped
        source = graph if isinstance(graph, bytes) else str(graph)
        self.session = onnxruntime.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        self.input_names = [node.name for node in self.session.get_inputs()]
        self.output_names = [node.name for node in self.session.get_outputs()]

    def __call__(self, rows: dict) -> dict[str, np.ndarray]:
        """rows: int64 arrays by field name (fields the graph does not read are ignored)."""
        missing = [name for name in self.input_names if name not in rows]
        if missing:
            raise ValueError(f"the graph reads {missing}, which the rows do not hold")
        feeds = {name: np.ascontiguousarray(rows[name], dtype=np.int64) for name in self.input_names}
        return dict(zip(self.output_names, self.session.run(self.output_names, feeds)))
