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
bfloat16: the same converted model asked for bf16, only on a CPU that computes it (AVX512_BF16
or AMX): OpenVINO's default there, its quality measured beside int8's (docs/embeddings.md).
int8: NNCF's post-training static quantization (model_type TRANSFORMER: matrix products with
int8 weights per channel and int8 activations at scales fixed by calibration, SmoothQuant and
bias correction; attention scores and softmax stay float) over packed rows of calibration
texts, the way sentence-transformers quantizes for OpenVINO through optimum-intel (which
calibrates on 300 sentences). Quality is measured, not assumed: docs/embeddings.md.

Start-up: the converted (and, int8, quantized) model is kept on disk and read back by later
processes (`read_cached`, `write_cached` over inference.graph_cache:
`$PACKED_TRANSFORMERS_CACHE/openvino/<key>/model.xml`, default `~/.cache/packed-transformers`;
an empty value turns it off; a cache that cannot be written is one warning line), keyed by everything it is made of:
the weights' bytes, the model's config, the model room's source files, the OpenVINO (and NNCF)
versions, and for int8 the calibration rows' bytes; compiled shapes go to OpenVINO's own
CACHE_DIR beside it. An entry appears by atomic rename; one that cannot be read is rebuilt.

Refused in one line (`openvino_problem`) where openvino (or, for int8, nncf) is not installed,
on a device other than the CPU, or for bfloat16 on a CPU without bf16 arithmetic.

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
import hashlib
import importlib.metadata
import importlib.util
import logging
import time
from pathlib import Path

import numpy as np
import torch

from packed_transformers.common.telemetry import decline_openvino_telemetry
from packed_transformers.inference import graph_cache

# before openvino is first imported: its conversion and NNCF send usage telemetry by default
# (common.telemetry says why and how a user turns it back on)
decline_openvino_telemetry()

log = logging.getLogger(__name__)

RUNTIME = "openvino"  # its folder in the graph cache
CALIBRATION_TEXTS = 300  # texts an int8 graph is calibrated on where the caller gives none
# The fewest it is calibrated on: `packed_encode(model, eight_texts, runtime="openvino",
# dtype="int8")` calibrated on 2 packed rows, cached that graph, and every later call and
# process reused it (min cosine 0.958 on 1,000 texts, 0.984 calibrated on them; issue 93).
# A floor against such a sample, not a measured sufficiency: 40 texts held the gate in
# tests/inference/test_openvino.py.
MIN_CALIBRATION_TEXTS = 24


def calibration_picks(n: int) -> np.ndarray:
    """The fixed sample an int8 graph is calibrated on where the caller gives no texts: up to
    CALIBRATION_TEXTS of `n` inputs, their indices in input order (the same every run)."""
    return np.sort(np.random.default_rng(0).choice(n, min(CALIBRATION_TEXTS, n), replace=False))


# float32: the graph asked for f32; bfloat16: the same graph asked for bf16 (matrix products in
# bf16 on AVX512_BF16 / AMX, as OpenVINO's CPU plugin picks by default there); int8: NNCF's
OPENVINO_DTYPES = ("float32", "bfloat16", "int8")
# the CPU plugin's INFERENCE_PRECISION_HINT for each float dtype (int8's graph: f32 around its int8 ops)
PRECISION_HINT = {"float32": "f32", "bfloat16": "bf16", "int8": "f32"}


def openvino_problem(device: str, dtype: str) -> str | None:
    """The one-line reason `runtime="openvino"` cannot run `dtype` on `device` here, or None."""
    if device != "cpu":
        return f"--runtime openvino runs on a CPU, not on {device}"
    if dtype not in OPENVINO_DTYPES:
        return f"--runtime openvino runs {', '.join(OPENVINO_DTYPES)}, not {dtype}"
    if dtype == "bfloat16":
        from packed_transformers.inference.runtime_choice import cpu_flags

        if not {"avx512_bf16", "amx_bf16"} & cpu_flags():
            return ("--runtime openvino --dtype bfloat16 needs a CPU that computes bf16 (AVX512_BF16 or AMX); "
                    "this one would emulate it, slower than float32 (use --dtype float32 or int8)")  # fmt: skip
    if dtype == "int8":
        from packed_transformers.inference.runtime_choice import (
            OPENVINO_INT8_WITHOUT_VNNI,
            cpu_flags,
            has_vnni,
        )

        if not has_vnni(cpu_flags()):
            return OPENVINO_INT8_WITHOUT_VNNI
    try:
        import openvino  # noqa: F401
    except ImportError:
        return "--runtime openvino: the openvino package is not installed (pip install packed-transformers[openvino])"
    # nncf is found, not imported (0.3 s): a process whose int8 graph is cached never quantizes
    if dtype == "int8" and importlib.util.find_spec("nncf") is None:
        return "--runtime openvino --dtype int8: the nncf package is not installed (pip install packed-transformers[openvino])"
    return None


def model_digest(model: torch.nn.Module, dtype: str) -> hashlib._Hash:
    """A running sha256 over what a converted graph is made of (the module's docstring)."""
    import openvino

    header = f"{dtype}|openvino {openvino.__version__}"
    if dtype == "int8":  # its version read, nncf not imported (0.3 s): a cached graph needs none of it
        header += f"|nncf {importlib.metadata.version('nncf')}"
    return graph_cache.model_digest(model, header)


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


def read_cached(key: str):
    """The cached openvino.Model of `key`, or None (absent, off, or unreadable: then removed)."""
    path = graph_cache.cached_file(RUNTIME, key, "model.xml")
    if path is None:
        return None
    try:
        with signal_stack_kept():
            return openvino_core().read_model(str(path))
    except Exception as err:  # noqa: BLE001 - OpenVINO raises RuntimeError subclasses of its own
        log.warning("%s: a cached graph that cannot be read (%s); building it again", path.parent,
                    str(err)[:200])  # fmt: skip
        graph_cache.discard(RUNTIME, key)
        return None


def write_cached(key: str, model) -> None:
    """Keep `model` under `key` (graph_cache.keep: a cache that cannot be written, whatever
    OpenVINO raises, is one warning line, and nothing half-written stays)."""
    import openvino

    def save(folder: Path) -> None:
        with signal_stack_kept():
            openvino.save_model(model, str(folder / "model.xml"), compress_to_fp16=False)

    graph_cache.keep(RUNTIME, key, save)


class OpenVinoGraphs:
    """`model`'s packed forward through OpenVINO: called as the model is (keyword tensors of
    one batch of rows), answering its outputs as float32 tensors by name."""

    def __init__(self, model: torch.nn.Module, dtype: str, threads: int):
        self.model, self.dtype, self.threads = model.eval(), dtype, threads
        self.converted = None  # the openvino.Model, rows and width open (quantized once for int8)
        self.compiled: dict[tuple, tuple] = {}  # row shape -> (infer request, its output names)
        self.calibrated = dtype != "int8"
        self.from_cache = False  # whether the (quantized) graph was read back from the cache
        self.setup_seconds = 0.0  # conversion, quantization and compilation, all shapes

    def _key(self, batch: dict) -> None:
        """The inputs' names and the running digest of what the graph is made of."""
        self.input_names = list(batch)
        self.digest = model_digest(self.model, self.dtype)
        self.digest.update("|".join(self.input_names).encode())

    def _convert(self, batch: dict):
        """The model converted with rows and width open (an openvino.Model)."""
        import openvino

        with torch.inference_mode(), signal_stack_kept():
            return openvino.convert_model(
                self.model, example_input=batch, input=[openvino.PartialShape([-1, -1])] * len(batch)
            )

    def _float32(self, batch: dict) -> None:
        started = time.perf_counter()
        self._key(batch)
        key = "fp32-" + self.digest.hexdigest()[:32]
        self.converted = read_cached(key)
        self.from_cache = self.converted is not None
        if self.converted is None:
            self.converted = self._convert(batch)
            write_cached(key, self.converted)
        self.setup_seconds += time.perf_counter() - started

    def calibrate(self, batches: list[dict]) -> None:
        """int8: quantize the converted model on `batches` (rows as pack_rows makes them, numpy
        int64, any shapes), or read the graph quantized on the same rows back from the cache.
        Once; a later call changes nothing."""
        if self.calibrated:
            return
        texts = sum(int((batch["example_index"] >= 0).sum()) for batch in batches)
        if texts < MIN_CALIBRATION_TEXTS:
            from packed_transformers.data.classification_data import ExampleError

            raise ExampleError(
                f"--runtime openvino --dtype int8 calibrates on the texts it is first given: {texts} here, fewer "
                f"than {MIN_CALIBRATION_TEXTS}; give more texts at once (the API: calibration_texts=...), "
                "or use --runtime onnxruntime --dtype int8, which needs no calibration"
            )
        started = time.perf_counter()
        first = {name: torch.from_numpy(value) for name, value in batches[0].items()}
        self._key(first)
        feeds = [[batch[name] for name in self.input_names] for batch in batches]
        digest = self.digest.copy()
        for feed in feeds:
            for array in feed:
                digest.update(f"{array.shape}".encode())
                digest.update(np.ascontiguousarray(array).tobytes())
        key = "int8-" + digest.hexdigest()[:32]
        self.converted = read_cached(key)
        self.from_cache = self.converted is not None
        if self.converted is None:
            import nncf

            with signal_stack_kept():  # NNCF compiles the model on Cores of its own to calibrate
                self.converted = nncf.quantize(
                    self._convert(first), nncf.Dataset(feeds), model_type=nncf.ModelType.TRANSFORMER,
                    subset_size=len(feeds),
                )  # fmt: skip
            write_cached(key, self.converted)
        self.calibrated = True
        self.setup_seconds += time.perf_counter() - started

    def __call__(self, **batch) -> dict:
        if not self.calibrated:
            raise RuntimeError(
                "OpenVinoGraphs: int8 graphs are calibrated (calibrate) before their first batch"
            )
        if self.converted is None:
            self._float32(batch)
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
        settings = {
            "INFERENCE_PRECISION_HINT": PRECISION_HINT[self.dtype],
            "INFERENCE_NUM_THREADS": self.threads,
        }
        # compiled shapes kept by OpenVINO itself, beside the graphs, only where it can write
        # there: its compile fails on a CACHE_DIR it cannot create
        compiled_cache = graph_cache.cache_root(RUNTIME)
        if compiled_cache is not None and graph_cache.writable_folder(compiled_cache / "compiled"):
            settings["CACHE_DIR"] = str(compiled_cache / "compiled")
        with signal_stack_kept():
            compiled = openvino_core().compile_model(model, "CPU", settings)
        # the model's outputs by the names its forward gives them (the dict keys)
        outputs = {}
        for port in compiled.outputs:
            names = port.get_names()
            named = sorted(n for n in names if not n.isdigit())
            outputs[named[0] if named else port.get_any_name()] = port
        self.compiled[shape] = (compiled.create_infer_request(), outputs)
        self.setup_seconds += time.perf_counter() - started
