"""An exported folder's graph as the Runner's Backend, without torch: its session (ONNX
Runtime or OpenVINO, as the folder was exported for) behind inference.backend.SessionBackend,
so that embed, predict and the server run an exported folder through the Runner they run a
torch model through (inference.embedding, inference.classify, serving/).

    runner = runner_of(loaded, "cpu", "float32")     # inference.runner: over exported_backend(loaded)
    for batch in runner.run(token_ids, tables, width_of, segment_ids, ("embeddings",)): ...

The folder fixes the runtime and dtype (its graph was made for them): asking for others is a
one-line ValueError. Threads: the runtime's (intra-op) threads, $OMP_NUM_THREADS where set,
else the CPUs this process may run on.
"""

from __future__ import annotations

import os

from packed_transformers.common.install_advice import pip_install
from packed_transformers.door.exported_folder import exported_problem
from packed_transformers.inference.backend import SessionBackend
from packed_transformers.packs.rows import ROW_FIELDS


def default_threads() -> int:
    """$OMP_NUM_THREADS, else the CPUs this process may run on."""
    chosen = os.environ.get("OMP_NUM_THREADS", "")
    if chosen.isdigit() and int(chosen) > 0:
        return int(chosen)
    return len(os.sched_getaffinity(0))


def opened_graph(model, threads: int):
    """The exported folder's graph in a session of its runtime (ONNX Runtime, OpenVINO), checked
    to be the packed graph its packed_export.json describes (packed rows in, its outputs of
    their width out); ExampleError naming the file for a graph the runtime cannot load (empty,
    cut short, not a graph), another model's, a runtime not installed, or bf16 on a CPU
    without it."""
    from packed_transformers.data.classification_data import ExampleError

    info = model.info
    try:
        session, widths = _session_of(model, threads)
    except ExampleError:
        raise
    # the runtimes' load errors (InvalidProtobuf, Fail, RuntimeError, ...) share no base
    except Exception as err:
        reason = (str(err).splitlines() or [type(err).__name__])[0][:200]
        raise ExampleError(
            f"{model.path}: {RUNTIME_NAMES[info.runtime]} cannot load this graph ({reason}); export the model again"
        ) from None
    reads_rows = "input_ids" in session.input_names and set(session.input_names) <= set(ROW_FIELDS)
    if not set(info.outputs) <= set(widths) or not reads_rows:
        raise ExampleError(
            f"{model.path}: a graph of inputs {session.input_names} and outputs {sorted(widths)}, not the packed "
            f"graph its packed_export.json describes (outputs {list(info.outputs)}); export the model again"
        )
    for name in info.outputs:
        if isinstance(widths[name], int) and widths[name] != info.dimension:
            raise ExampleError(
                f"{model.path}: its {name} are {widths[name]} wide; packed_export.json says dimension={info.dimension}"
            )
    return session


RUNTIME_NAMES = {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}


def _session_of(model, threads: int) -> tuple:
    """(session, {output: its last dimension or None}) of the folder's graph in its runtime."""
    from packed_transformers.data.classification_data import ExampleError

    info = model.info
    if info.runtime == "openvino":
        import importlib.util

        from packed_transformers.inference.openvino_session import OpenVinoSession
        from packed_transformers.inference.runtime_choice import cpu_flags, openvino_computes_bf16

        if importlib.util.find_spec("openvino") is None:
            raise ExampleError(f"{model.path}: an OpenVINO graph; the openvino package is not installed "
                               f"({pip_install('openvino')})")  # fmt: skip
        if info.dtype == "bfloat16" and not openvino_computes_bf16(cpu_flags()):
            raise ExampleError(f"{model.path}: a bfloat16 graph, and this CPU computes no bf16 (AVX512_BF16 or "
                               "AMX): export the model again with --runtime openvino --dtype float32")  # fmt: skip
        session = OpenVinoSession(model.path, info.dtype, threads)
        widths = {}
        for port, name in zip(session.graph.outputs, session.output_names):
            last = port.get_partial_shape()[-1] if port.get_partial_shape().rank.is_static else None
            widths[name] = last.get_length() if last is not None and last.is_static else None
        return session, widths
    from packed_transformers.inference.onnx_session import OnnxSession

    session = OnnxSession(model.path, threads)
    return session, {
        node.name: node.shape[-1] if node.shape else None for node in session.session.get_outputs()
    }


def check_exported_asking(
    loaded, device: str, dtype: str | None, compiled: bool, runtime: str | None
) -> None:
    """ValueError (one line) for a device, dtype or runtime the exported LoadedModel's graph
    was not made for, or --compile."""
    if compiled:
        raise ValueError("an exported folder runs its graph: --compile compiles torch's forward")
    # the options' defaults (torch, float32) mean "as the folder says" here
    info = loaded.model.info
    problem = exported_problem(info, str(device), None if dtype in ("float32", info.dtype) else dtype,
                               None if runtime == "torch" else runtime)  # fmt: skip
    if problem:
        raise ValueError(problem)


def exported_backend(loaded) -> SessionBackend:
    """The exported LoadedModel's backend: its graph's session, opened and checked here."""
    info = loaded.model.info
    return SessionBackend(opened_graph(loaded.model, default_threads()), info.runtime, info.dtype)
