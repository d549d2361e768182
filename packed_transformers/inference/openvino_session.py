"""A packed graph run by OpenVINO's CPU plugin: packed rows (numpy int64, as packs.rows.pack_rows
makes them) in, the model's outputs (numpy float32, by name) out. No torch: the exported
folder's torch-free process (door.exported_folder, a folder of `packed export --runtime
openvino`) and the `--runtime openvino` Runner (inference.openvino_graphs, which converts a torch
model to the openvino.Model this runs) both run their graphs here.

    session = OpenVinoSession(openvino_model_or_xml_path, "bfloat16", threads=2)
    outputs = session(rows)          # {"embeddings": [rows, K, D]} or {"logits": [rows, K, C]}

The graph is compiled once, at its first batch, for every row shape up to ROWS_BOUND rows and
SPAN_BOUND tokens or slots a row (each dimension bounded, not open), with the precision asked
(INFERENCE_PRECISION_HINT: f32, or bf16 where the CPU computes it) and `threads` threads; a
shape past the bounds gets a graph of its own. Measured on an AMX Xeon (OpenVINO 2026.4.1,
MiniLM-L6, 2,000 mixed texts, docs/embeddings.md): one bounded graph ran bf16 (vectors 1.5e-3
from f32's) in 2.4 s a whole process, cold, and 380 MB, where a graph per row shape took 3.7 s
cold (its compiles), 2.75 s warm and 0.6-1.4 GB; with the dimensions open (-1) instead of
bounded, the CPU plugin asked for bf16 computed f32 (vectors within 3.3e-5 of f32's). So the
bounded graph asked for bf16 is checked once compiled: where the plugin's record of it
(`dense_precisions`) has a dense product in f32 (a CPU kind not measured may do so), the
session compiles per row shape instead, as it did before, and says so in one log line.
Compiled graphs are kept by OpenVINO in its CACHE_DIR (inference.graph_cache's openvino
folder, `compiled/<dtype>/`: a folder per precision) where that can be written.

Signals: OpenVINO's CPU plugin (2026.4.1, measured) gives the thread that compiles an
alternate signal stack of its own, and when a plugin instance is unloaded puts back the stack
it found. With a Core per compiled shape released in the order they were made, the thread
ended on a stack already unmapped, and the next signal a Python handler ran for (SIGCHLD,
SIGINT, SIGTERM: CPython runs its handlers on the alternate stack) killed the process with
SIGSEGV. So one Core serves the process (`openvino_core`: its plugin never unloaded before
exit), and the thread's own stack is put back after each OpenVINO call that may change it
(`signal_stack_kept`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import time
from pathlib import Path

import numpy as np

from packed_transformers.common.telemetry import decline_openvino_telemetry
from packed_transformers.inference import graph_cache
from packed_transformers.packs.rows import ROW_FIELDS

log = logging.getLogger(__name__)

# before openvino is first imported: its conversion and NNCF send usage telemetry by default
# (common.telemetry says why and how a user turns it back on)
decline_openvino_telemetry()

RUNTIME = "openvino"  # its folder in the graph cache, and an exported folder's runtime
# float32: the graph asked for f32 (no bf16 or f16 the CPU plugin might pick); bfloat16: the
# same graph asked for bf16 (matrix products in bf16 on AVX512_BF16 / AMX, as OpenVINO's CPU
# plugin picks by default there); int8: NNCF's static int8 graph, f32 around its int8 ops
OPENVINO_DTYPES = ("float32", "bfloat16", "int8")
# the CPU plugin's INFERENCE_PRECISION_HINT for each dtype
PRECISION_HINT = {"float32": "f32", "bfloat16": "bf16", "int8": "f32"}
# the one compiled graph's bounds: rows a batch, and a row's tokens (its width) or slots
ROWS_BOUND, SPAN_BOUND = 4096, 8192
WITHIN_BOUNDS = "within bounds"  # the key of the bounded graph among the compiled ones


class _SignalStack(ctypes.Structure):
    """POSIX stack_t (sigaltstack's argument) on Linux x86-64."""

    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


_SS_DISABLE = 2  # Linux: the thread has no alternate signal stack


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _signal_stack() -> _SignalStack | None:
    """The calling thread's alternate signal stack (None where sigaltstack is not there)."""
    libc = _libc()
    current = _SignalStack()
    if not hasattr(libc, "sigaltstack") or libc.sigaltstack(None, ctypes.byref(current)) != 0:
        return None
    return current


@contextlib.contextmanager
def signal_stack_kept():
    """Run the block, then give the calling thread back the alternate signal stack it had
    before, where OpenVINO replaced it (the module docstring says why)."""
    before = _signal_stack()
    try:
        yield
    finally:
        now = _signal_stack()
        if (
            before is not None
            and now is not None
            and (now.ss_sp, now.ss_size) != (before.ss_sp, before.ss_size)
        ):
            if before.ss_flags & _SS_DISABLE:
                before = _SignalStack(None, _SS_DISABLE, 0)
            else:
                before.ss_flags = 0
            _libc().sigaltstack(ctypes.byref(before), None)


def signal_stack_mapped() -> bool:
    """Whether the calling thread's alternate signal stack, if it has one, lies in mapped
    memory (/proc/self/maps): a signal delivered onto an unmapped one kills the process."""
    current = _signal_stack()
    if current is None or current.ss_flags & _SS_DISABLE or not current.ss_sp:
        return True
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(bound, 16) for bound in line.split()[0].split("-"))
            if start <= current.ss_sp and current.ss_sp + current.ss_size <= end:
                return True
    return False


@functools.cache
def openvino_core():
    """The process's one openvino.Core (its CPU plugin loaded once, unloaded at exit only)."""
    import openvino

    with signal_stack_kept():
        return openvino.Core()


def read_graph(path: Path):
    """The openvino.Model of an IR file (model.xml, its weights in model.bin beside it)."""
    with signal_stack_kept():
        return openvino_core().read_model(str(path))


class OpenVinoSession:
    """One packed openvino.Model (or the path of its model.xml), compiled per row shape.

    input_names: the rows' fields it reads, in its inputs' order; output_names: its outputs
    by the names the model's forward gave them; setup_seconds: compilation, all shapes."""

    def __init__(self, graph, dtype: str, threads: int):
        if dtype not in OPENVINO_DTYPES:
            raise ValueError(f"OpenVINO runs {', '.join(OPENVINO_DTYPES)}, not {dtype}")
        self.graph = read_graph(graph) if isinstance(graph, (str, Path)) else graph
        self.dtype, self.threads = dtype, max(1, int(threads))
        self.input_names = [input_name(port) for port in self.graph.inputs]
        self.output_names = [output_name(port) for port in self.graph.outputs]
        # WITHIN_BOUNDS, or a row shape past the bounds -> (its infer request, {name: port})
        self.graphs: dict[object, tuple] = {}
        # False once the plugin kept f32 in the bounded graph asked for bf16: a graph per row shape
        self.bounded = True
        self.setup_seconds = 0.0

    def __call__(self, rows: dict) -> dict[str, np.ndarray]:
        """rows: int64 arrays by field name (fields the graph does not read are ignored)."""
        missing = [name for name in self.input_names if name not in rows]
        if missing:
            raise ValueError(f"the graph reads {missing}, which the rows do not hold")
        feeds = [np.ascontiguousarray(rows[name], dtype=np.int64) for name in self.input_names]
        shape = tuple(feed.shape for feed in feeds)
        key = graph_key(shape) if self.bounded else shape
        if key not in self.graphs:
            key = self._compile(shape, key)
        request, outputs = self.graphs[key]
        answer = request.infer(feeds)
        return {name: np.array(answer[port]) for name, port in outputs.items()}

    def _compile(self, shape: tuple, key) -> object:
        """The graph rows of `shape` run in, compiled and kept under `key` (WITHIN_BOUNDS: the
        bounded one; else `shape` itself), or under `shape` where the bounded graph kept f32
        products asked for bf16 (the session compiles per row shape from then on). -> its key."""
        import openvino

        started = time.perf_counter()
        model = self.graph.clone()
        if key == WITHIN_BOUNDS:
            shapes = [[openvino.Dimension(1, ROWS_BOUND), *[openvino.Dimension(1, SPAN_BOUND)] * (port.get_partial_shape().rank.get_length() - 1)]
                      for port in model.inputs]  # fmt: skip
        else:
            shapes = [list(dims) for dims in shape]
        model.reshape({port: openvino.PartialShape(dims) for port, dims in zip(model.inputs, shapes)})
        settings = {
            "INFERENCE_PRECISION_HINT": PRECISION_HINT[self.dtype],
            "INFERENCE_NUM_THREADS": self.threads,
        }
        # compiled shapes kept by OpenVINO itself, beside the converted graphs, only where it can
        # write there: its compile fails on a CACHE_DIR it cannot create
        compiled_cache = graph_cache.cache_root(RUNTIME)
        # a folder per precision: one process that compiled a graph in f32 and then the same graph
        # in bf16 through one CACHE_DIR died in its next inference (SIGSEGV, OpenVINO 2026.4.1 on an
        # AMX Xeon: `packed export` of float32 then bfloat16 in one process; across processes, and
        # with no cache, it did not); tests/inference/test_exported_openvino.py repeats it
        compiled_here = None if compiled_cache is None else compiled_cache / "compiled" / self.dtype
        if compiled_here is not None and graph_cache.writable_folder(compiled_here):
            settings["CACHE_DIR"] = str(compiled_here)
        with signal_stack_kept():
            compiled = openvino_core().compile_model(model, "CPU", settings)
        self.setup_seconds += time.perf_counter() - started
        if key == WITHIN_BOUNDS and self.dtype == "bfloat16" and "f32" in dense_precisions(compiled):
            self.bounded = False
            log.info(
                "OpenVINO kept float32 products in the bounded bf16 graph: compiling a graph per row shape"
            )
            return self._compile(shape, shape)
        outputs = {output_name(port): port for port in compiled.outputs}
        self.graphs[key] = (compiled.create_infer_request(), outputs)
        return key


def dense_precisions(compiled) -> set[str]:
    """The precisions the CPU plugin records for the dense products (FullyConnected layers) of a
    compiled graph, from its runtime model ("bf16", "f32", "i8", ...)."""
    found = set()
    for op in compiled.get_runtime_model().get_ops():
        info = op.get_rt_info()
        if "layerType" in info and info["layerType"].astype(str) == "FullyConnected":
            found.add(info["runtimePrecision"].astype(str))
    return found


def graph_key(shape: tuple) -> object:
    """Which graph rows of `shape` (each input's dims) run in: WITHIN_BOUNDS, or the shape itself
    where a dimension is past its bound (or empty)."""
    within = all(1 <= dims[0] <= ROWS_BOUND and all(1 <= d <= SPAN_BOUND for d in dims[1:]) for dims in shape)
    return WITHIN_BOUNDS if within else shape


def input_name(port) -> str:
    """An input's name: the packed rows' field it reads (OpenVINO's conversion gives it that
    name beside ones of its own, "input.1")."""
    fields = sorted(set(port.get_names()) & set(ROW_FIELDS))
    return fields[0] if fields else port.get_any_name()


def output_name(port) -> str:
    """An output's name as the model's forward gave it (the dict key; OpenVINO adds numeric
    tensor names beside it)."""
    named = sorted(name for name in port.get_names() if not name.isdigit())
    return named[0] if named else port.get_any_name()
