"""The packed inference forward, written once: batch tables -> rows -> device -> dtype ->
model -> numpy -> input order. predict, QA, embed, `packed_pipeline` and the server all
run their models through a `Runner`.

    runner = Runner(model, device="cpu", dtype="float32")   # device and dtype checked here, once
    for batch in runner.run(token_ids, tables, width_of, segment_ids, outputs=("logits",)):
        ...                                                 # batch.rows (numpy), batch.outputs (numpy)
    logits = per_sequence(batches, "logits", n)             # [n, ...] in input order
    start = per_token(batches, "start_logits", lengths)     # [n, longest], -inf past each end

A table is [rows, K] example indices (-1: an empty slot; packs.batching or a serving
policy makes it); `width_of(table)` its row width in tokens. The runner keeps the pass's
figures in `stats` (batches, forward seconds, real and row tokens): the timing and
padding a command reports come from here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from packed_transformers.common.choices import GRAPH_RUNTIMES, RUNTIMES
from packed_transformers.inference.backend import Backend, RunBatch, RunStats  # noqa: F401 (read from here too)
from packed_transformers.packs.rows import pack_rows, unpack_outputs, unpack_token_outputs

# torch is imported where a torch model's backend is built, never at import: an exported
# folder's process (inference.exported_backend) runs this module's Runner without it

log = logging.getLogger(__name__)


@dataclass
class Runner:
    """A model's packed forward over a `Backend` (inference.backend), with the pass's figures.

    Runner(model, device, dtype, compiled=, runtime=): a torch model, its backend built here
    (`backend_of`: the one place a runtime is chosen; ValueError, one line, where this machine
    cannot run that runtime, device or dtype). An exported folder's Runner is given its backend
    (inference.exported_backend: `backend=`, the model its ExportedGraph)."""

    model: object  # torch.nn.Module (int8: its quantized copy), or an exported folder's ExportedGraph
    device: str | None = None  # None: where the model's parameters are
    dtype: str = "float32"
    stats: RunStats = field(default_factory=RunStats)
    # torch.compile the forward (inductor, weights frozen into the graph, static shapes): one
    # graph per row width, the tables of a width padded with empty rows to its most rows
    compiled: bool = False
    # "torch"; "openvino": the rows through OpenVINO (inference.openvino_graphs), one graph
    # compiled for every row shape up to bounds; "onnxruntime": through ONNX Runtime
    # (inference.onnx_graphs), one graph with rows and width open; float32 or int8 on either
    runtime: str = "torch"
    backend: Backend | None = None  # given: used as it is; None: backend_of builds it

    def __post_init__(self):
        if self.backend is None:
            self.backend, self.device = backend_of(
                self.model, self.device, self.dtype, self.compiled, self.runtime
            )
            self.model = getattr(self.backend, "model", self.model)  # int8: the quantized copy
        # fixed_shapes: (rows, slots) of each width's tables so far
        self._rows_of_width: dict[int, tuple[int, int]] = {}

    def _static_rows(self, table: np.ndarray, width: int) -> np.ndarray:
        """A fixed-shape backend's `table` padded with empty rows and slots (-1) to the most
        rows and slots seen at `width`, so that every forward at a width has one shape (more
        than before: one new graph)."""
        seen_rows, seen_depth = self._rows_of_width.get(width, (0, 0))
        rows, depth = max(seen_rows, len(table)), max(seen_depth, table.shape[1])
        self._rows_of_width[width] = (rows, depth)
        return np.pad(table, ((0, rows - len(table)), (0, depth - table.shape[1])), constant_values=-1)

    @property
    def needs_calibration(self) -> bool:
        """A static int8 graph not yet calibrated (`calibrate` before its first forward)."""
        return not self.backend.calibrated

    @staticmethod
    def calibration_rows(
        token_ids: list, tables: Iterable[np.ndarray], width_of: Callable[[np.ndarray], int],
        segment_ids: list | None = None,
    ) -> list[dict]:  # fmt: skip
        """The packed rows of `tables` over `token_ids` (and `segment_ids`), as forward feeds them."""
        return [pack_rows(token_ids, table, width_of(table), segment_ids) for table in tables]

    def calibrate(self, rows: list[dict]) -> None:
        """Static int8 (OpenVINO): quantize on packed `rows` (calibration_rows of texts like
        those to come, every row width among them; never counted in `stats`). Once: a later
        call changes nothing."""
        self.backend.calibrate(rows)

    def run(
        self, token_ids: list, tables: Iterable[np.ndarray], width_of: Callable[[np.ndarray], int],
        segment_ids: list | None = None, outputs: Iterable[str] = ("logits",),
    ) -> Iterator[RunBatch]:  # fmt: skip
        """Each of a pass's tables through `forward` in turn (a generator: the caller may
        consume batch by batch)."""
        outputs = tuple(outputs)
        for table in tables:
            yield self.forward(token_ids, table, width_of(table), segment_ids, outputs)

    def forward(
        self, token_ids: list, table: np.ndarray, width: int, segment_ids: list | None = None,
        outputs: Iterable[str] = ("logits",), read: Callable[[dict, dict], dict] | None = None,
        inputs: Callable[[dict], dict] | None = None,
    ) -> RunBatch:  # fmt: skip
        """One table's rows through the backend -> RunBatch. read: where an output is too
        large to bring back whole (a causal LM's [rows, width, vocabulary] logits), a
        reduction on the device, (batch tensors, model outputs) -> {name: numpy array}, in
        place of `outputs`. inputs: the model's inputs beyond the rows, from the batch's
        tensors (a causal LM's next-token targets, so that its head runs only where one is);
        `read` sees them in its batch. Both torch's alone."""
        if self.backend.fixed_shapes:
            table = self._static_rows(table, width)
        rows = pack_rows(token_ids, table, width, segment_ids)
        started = time.perf_counter()
        arrays = self.backend(rows, tuple(outputs), read, inputs)
        self.stats.count(table, width, token_ids, time.perf_counter() - started)
        return RunBatch(rows, arrays)


def backend_of(model, device: str | None, dtype: str, compiled: bool, runtime: str) -> tuple[Backend, object]:
    """A torch model's Backend for `runtime` (torch, onnxruntime or openvino; "auto" is
    resolved by the caller, who knows the task) on `device` (None: where its parameters are)
    in `dtype`, and that device: the one place a runtime is chosen. ValueError (one line)
    where this machine cannot run it."""
    import torch

    parameter = next(model.parameters(), None)
    if device:
        device = torch.device(device)
    else:
        device = parameter.device if parameter is not None else torch.device("cpu")
    if runtime not in ("torch", *GRAPH_RUNTIMES):
        raise ValueError(
            f"Runner runs torch, {' or '.join(GRAPH_RUNTIMES)}, not {runtime!r} (resolve auto first)"
        )
    problem = runtime_problem(runtime, device.type, dtype, compiled=compiled)
    if problem:
        raise ValueError(problem)
    if runtime == "openvino":
        from packed_transformers.inference.openvino_graphs import OpenVinoGraphs

        return OpenVinoGraphs(model.to(device), dtype, torch.get_num_threads()), device
    if runtime == "onnxruntime":
        from packed_transformers.inference.onnx_graphs import OnnxGraphs

        return OnnxGraphs(model.to(device), dtype, torch.get_num_threads()), device
    from packed_transformers.inference.torch_backend import TorchBackend

    return TorchBackend(model, device, dtype, compiled), device


def per_sequence(batches: list[RunBatch], name: str, n: int) -> np.ndarray:
    """A per-slot output [rows, K, ...] of every batch back to input order [n, ...]; raises
    unless every sequence 0..n-1 appears exactly once."""
    values = np.concatenate([b.outputs[name].reshape(-1, 1, *b.outputs[name].shape[2:]) for b in batches])
    index = np.concatenate([b.rows["example_index"].reshape(-1, 1) for b in batches])
    return unpack_outputs(values, index, n)


def per_token(batches: list[RunBatch], name: str, lengths: np.ndarray) -> np.ndarray:
    """A per-token output [rows, width] of every batch back to one row per sequence in
    input order: float32 [n, max(lengths)], -inf past each sequence's end. Batches may have
    different widths."""
    width = max(b.outputs[name].shape[1] for b in batches)

    def widen(values):
        return np.pad(values, ((0, 0), (0, width - values.shape[1])), constant_values=-np.inf)

    values = np.concatenate([widen(b.outputs[name]) for b in batches])
    cls = np.concatenate([b.rows["cls_positions"] for b in batches])
    index = np.concatenate([b.rows["example_index"] for b in batches])
    return unpack_token_outputs(values, cls, index, np.asarray(lengths))


def per_sequence_tokens(batches: list[RunBatch], name: str, lengths) -> list[np.ndarray]:
    """A per-token output with trailing dimensions ([rows, width, C]: token classification's
    logits) cut per sequence, in input order: [lengths[i], C] for sequence i ([CLS] first).
    Raises unless every sequence 0..n-1 appears exactly once."""
    n = len(lengths)
    out: list = [None] * n
    for batch in batches:
        values, cls, index = batch.outputs[name], batch.rows["cls_positions"], batch.rows["example_index"]
        for row, slot in zip(*np.nonzero(index >= 0)):
            i, first = int(index[row, slot]), int(cls[row, slot])
            if out[i] is not None:
                raise ValueError(f"sequence {i} appears twice in the batches")
            out[i] = values[row, first : first + int(lengths[i])]
    missing = [i for i, v in enumerate(out) if v is None]
    if missing:
        raise ValueError(f"sequences {missing[:5]} are missing from the batches")
    return out


def runtime_problem(
    runtime: str, device: str, dtype: str, ray: bool = False, compiled: bool = False
) -> str | None:
    """The one-line reason `runtime` cannot run `dtype` on `device` here (on Ray's replicas,
    or under torch.compile), or None. auto: the problem of what it picks for a pooled head on
    this machine (inference.runtime_choice); a command resolves auto for its folder's task and
    asks again where that gives torch."""
    if runtime not in RUNTIMES:
        return f"--runtime must be one of {RUNTIMES}, got {runtime!r}"
    if runtime == "auto":
        from packed_transformers.inference.runtime_choice import resolved_runtime

        chosen = resolved_runtime(runtime, "embedding", device, dtype, ray=ray, compiled=compiled).runtime
        return runtime_problem(chosen, device, dtype, ray, compiled)
    if runtime in GRAPH_RUNTIMES:
        if ray:
            return f"--runtime {runtime} runs without --ray (the Ray replicas run torch)"
        if compiled:
            return f"--runtime {runtime} runs without --compile (torch.compile compiles torch's forward)"
    if runtime == "onnxruntime":
        from packed_transformers.inference.onnx_session import onnxruntime_problem

        return onnxruntime_problem(device, dtype)
    if runtime == "openvino":
        from packed_transformers.inference.openvino_graphs import openvino_problem

        return openvino_problem(device, dtype)
    from packed_transformers.inference.precision import device_problem

    return device_problem(device, dtype)


def runner_of(loaded, device: str, dtype: str, compiled: bool = False, runtime: str = "torch") -> Runner:
    """A LoadedModel's Runner on `device` in `dtype` (compiled or not, through `runtime`;
    "auto": this CPU's choice for the folder's task, inference.runtime_choice), built (and so
    checked) once per setting and kept on the LoadedModel."""
    from packed_transformers.door.exported_folder import ExportedGraph
    from packed_transformers.inference.runtime_choice import resolved_runtime

    if isinstance(loaded.model, ExportedGraph):  # an exported folder: its own graph, no torch
        from packed_transformers.inference.exported_backend import check_exported_asking, exported_backend

        check_exported_asking(loaded, device, dtype, compiled, runtime)  # the folder fixes runtime and dtype
        key = ("exported",)
        if key not in loaded._runners:
            backend = exported_backend(loaded)
            loaded._runners[key] = Runner(
                loaded.model, "cpu", backend.dtype, runtime=backend.runtime, backend=backend
            )
        return loaded._runners[key]
    chosen = resolved_runtime(runtime, loaded.spec.task, str(device), dtype, compiled=compiled)
    key = (str(device), dtype, compiled, chosen.runtime)
    if key not in loaded._runners:
        if chosen.why:  # the Python API's auto says what it chose, once per runner
            log.info("%s", chosen.why)
        loaded._runners[key] = Runner(loaded.model, device, dtype, compiled=compiled, runtime=chosen.runtime)
    return loaded._runners[key]
