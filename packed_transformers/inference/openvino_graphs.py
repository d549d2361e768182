"""Packed rows through OpenVINO (`runtime="openvino"`): what only fixed-shape packs allow on a
CPU. The packed model, its block-diagonal attention inside, is converted to an OpenVINO model
once (rows and width left open), then compiled once for every row shape up to bounds
(inference.openvino_session: the bounds are what lets the CPU plugin compute bf16; no batch is
padded to a shape).

    graphs = OpenVinoGraphs(model, "int8", threads=2)
    graphs.calibrate([rows, ...])         # int8: packed rows of texts like the ones to come
    out = graphs(rows, ("embeddings",))   # numpy rows in: {"embeddings": float32 [rows, K, D]}

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

The graph runs in inference.openvino_session (torch-free: an exported folder's process runs
the same session), which also holds the process's one Core and why it keeps signal stacks.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import logging
import time
from pathlib import Path

import numpy as np
import torch

from packed_transformers.common.install_advice import pip_install
from packed_transformers.inference import graph_cache
from packed_transformers.inference.backend import Backend, graph_reads_whole
from packed_transformers.inference.openvino_session import (
    OPENVINO_DTYPES,
    RUNTIME,
    OpenVinoSession,
    openvino_core,
    signal_stack_kept,
)

log = logging.getLogger(__name__)

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


def openvino_problem(device: str, dtype: str) -> str | None:
    """The one-line reason `runtime="openvino"` cannot run `dtype` on `device` here, or None."""
    if device != "cpu":
        return f"--runtime openvino runs on a CPU, not on {device}"
    if dtype not in OPENVINO_DTYPES:
        return f"--runtime openvino runs {', '.join(OPENVINO_DTYPES)}, not {dtype}"
    if dtype == "bfloat16":
        from packed_transformers.inference.runtime_choice import (
            OPENVINO_BF16_WITHOUT_INSTRUCTIONS,
            cpu_flags,
            openvino_computes_bf16,
        )

        if not openvino_computes_bf16(cpu_flags()):
            return OPENVINO_BF16_WITHOUT_INSTRUCTIONS
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
        return f"--runtime openvino: the openvino package is not installed ({pip_install('openvino')})"
    # nncf is found, not imported (0.3 s): a process whose int8 graph is cached never quantizes
    if dtype == "int8" and importlib.util.find_spec("nncf") is None:
        return f"--runtime openvino --dtype int8: the nncf package is not installed ({pip_install('nncf')})"
    return None


def model_digest(model: torch.nn.Module, dtype: str) -> hashlib._Hash:
    """A running sha256 over what a converted graph is made of (the module's docstring)."""
    import openvino

    header = f"{dtype}|openvino {openvino.__version__}"
    if dtype == "int8":  # its version read, nncf not imported (0.3 s): a cached graph needs none of it
        header += f"|nncf {importlib.metadata.version('nncf')}"
    return graph_cache.model_digest(model, header)


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


@contextlib.contextmanager
def nncf_quiet():
    """NNCF's quantization without its noise on stdout, where a command's own answer goes (a
    JSON summary): its progress bars (rich, written to sys.stdout) dropped, its log lines
    (a handler on stdout, INFO and up) sent to stderr from WARNING up."""
    import io
    import sys

    from nncf.common.logging.logger import nncf_logger

    handlers = [h for h in nncf_logger.handlers if isinstance(h, logging.StreamHandler)]
    before = [(h.stream, h.level) for h in handlers]
    for handler in handlers:  # the attribute, not setStream: that flushes the old stream, which a
        handler.stream = sys.stderr  # test's captured stdout may have closed since nncf's import
        handler.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for handler, (stream, level) in zip(handlers, before):
            handler.stream = stream
            handler.setLevel(level)


def name_inputs(model, names: list[str]):
    """`model` (an openvino.Model converted from the packed forward, its inputs in the order of
    the batch it was traced with) with its inputs named by the rows' fields `names`: the
    conversion names them after traced values ("input.1"), and a session (inference.
    openvino_session) and a saved IR feed them by name."""
    for port, name in zip(model.inputs, names):
        if name not in port.get_names():
            port.get_tensor().set_names({name})
    return model


class OpenVinoGraphs(Backend):
    """`model`'s packed forward through OpenVINO, a Backend (inference.backend): numpy rows in,
    float32 numpy outputs by name."""

    runtime = "openvino"
    fixed_shapes = False  # one graph for every row shape within the session's bounds: nothing padded

    def __init__(self, model: torch.nn.Module, dtype: str, threads: int):
        self.model, self.dtype, self.threads = model.eval(), dtype, threads
        self.converted = None  # the openvino.Model, rows and width open (quantized once for int8)
        self.session: OpenVinoSession | None = None  # the converted model, compiled once (bounded)
        self.calibrated = dtype != "int8"
        self.from_cache = False  # whether the (quantized) graph was read back from the cache
        self.setup_seconds = 0.0  # conversion, quantization and compilation, all shapes

    def _key(self, rows: dict) -> None:
        """The inputs' names and the running digest of what the graph is made of."""
        self.input_names = list(rows)
        self.digest = model_digest(self.model, self.dtype)
        self.digest.update("|".join(self.input_names).encode())

    def _convert(self, rows: dict):
        """The model converted with rows and width open (an openvino.Model); `rows` (numpy) its
        example input."""
        import openvino

        example = {name: torch.from_numpy(value) for name, value in rows.items()}
        with torch.inference_mode(), signal_stack_kept():
            return openvino.convert_model(
                self.model, example_input=example, input=[openvino.PartialShape([-1, -1])] * len(rows)
            )

    def convert(self, rows: dict) -> None:
        """The model converted (rows and width open; `rows` numpy, its example), or read back
        from the cache: once."""
        started = time.perf_counter()
        self._key(rows)
        key = "fp32-" + self.digest.hexdigest()[:32]
        self.converted = read_cached(key)
        self.from_cache = self.converted is not None
        if self.converted is None:
            self.converted = name_inputs(self._convert(rows), self.input_names)
            write_cached(key, self.converted)
        else:
            name_inputs(self.converted, self.input_names)  # an entry cached before inputs were named
        self.setup_seconds += time.perf_counter() - started

    @property
    def compiled(self) -> dict:
        """The graphs compiled so far (the session's: the bounded one, and any shape past it)."""
        return {} if self.session is None else self.session.graphs

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
        first = batches[0]
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

            # NNCF compiles the model on Cores of its own to calibrate
            with signal_stack_kept(), nncf_quiet():
                self.converted = nncf.quantize(
                    self._convert(first), nncf.Dataset(feeds), model_type=nncf.ModelType.TRANSFORMER,
                    subset_size=len(feeds),
                )  # fmt: skip
            write_cached(key, name_inputs(self.converted, self.input_names))
        else:
            name_inputs(self.converted, self.input_names)  # an entry cached before inputs were named
        self.calibrated = True
        self.setup_seconds += time.perf_counter() - started

    def __call__(self, rows: dict, outputs: tuple[str, ...], read=None, inputs=None) -> dict:
        """Backend's call: numpy rows in, numpy outputs out (converted at the first batch, a
        row shape compiled at its first)."""
        graph_reads_whole(read, inputs)
        if not self.calibrated:
            raise RuntimeError(
                "OpenVinoGraphs: int8 graphs are calibrated (calibrate) before their first batch"
            )
        if self.converted is None:
            self.convert(rows)
        if self.session is None:
            self.session = OpenVinoSession(self.converted, self.dtype, self.threads)
        before = self.session.setup_seconds
        answer = self.session(rows)
        self.setup_seconds += self.session.setup_seconds - before  # a shape's first batch compiles it
        return {name: answer[name] for name in outputs}
