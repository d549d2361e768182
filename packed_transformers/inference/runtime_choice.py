"""`--runtime auto`: which runtime runs the packed rows on this CPU, read from a table of
whole-process measurements (start-up included), one row per CPU kind and dtype.

    choice = choose_runtime(CpuKind.AVX512_VNNI, "float32", "embedding")   # pure
    choice.runtime, choice.why      # "openvino", "--runtime auto: openvino (AVX-512 with VNNI, float32: ...)"
    resolved_runtime("auto", "embedding", "cpu", "int8")    # the same, for this machine's kind

The candidates were torch eager, torch.compile, ONNX Runtime and OpenVINO on packed rows.
torch.compile lost to eager once its compile time counts (docs/embeddings.md, "torch.compile
at the pack widths"). ONNX Runtime ran the same exported encoder slower than OpenVINO on the
AVX-512 kind (fp32 and int8) and slower than packed torch's loop on the AVX2 kind (docs/
embeddings.md, "Against ONNX Runtime and OpenVINO", "The AVX2 kind"), so packed rows were
built for OpenVINO and not for it (ONNX Runtime on packed rows: not built, not measured).
What is left to choose is torch or OpenVINO, per CPU kind: a kind where OpenVINO on packed
rows was not measured gets torch, the default, and says so.

Decided here, once, for every door (embed, predict, the server, `packed_encode`): the kind
comes from the CPU's flags (`cpu_kind`, pure), the table gives the runtime, and anything
OpenVINO does not run (another task than a pooled head, a GPU, bfloat16, Ray's replicas,
torch.compile, openvino not installed, the server) falls back to torch with the reason in `why`. auto is
not the default: the vectors would then depend on the machine (int8 through OpenVINO is
another quantization than torch's), and the first OpenVINO process pays the conversion
(10-17 s for MiniLM-L6) that its graph cache saves later ones.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"


class CpuKind(enum.Enum):
    """The CPU kinds whose kernels differ: torch's and OpenVINO's pick AVX2, AVX-512 or AMX
    code, and int8 needs VNNI (inference.int8)."""

    AMX = "AMX (Xeon 4th generation and later)"
    AVX512_VNNI = "AVX-512 with VNNI"
    AVX2 = "AVX2 without AVX-512"
    OTHER = "none of AVX2, AVX-512 with VNNI or AMX"


def cpu_kind(flags: frozenset[str]) -> CpuKind:
    """The kind of a CPU with these /proc/cpuinfo flags."""
    if "amx_tile" in flags:
        return CpuKind.AMX
    if "avx512f" in flags and "avx512_vnni" in flags:
        return CpuKind.AVX512_VNNI
    if "avx2" in flags:
        return CpuKind.AVX2
    return CpuKind.OTHER


def this_cpu_kind(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuKind:
    """This machine's kind (its first processor's flags; OTHER where they cannot be read)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return cpu_kind(frozenset(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return CpuKind.OTHER


@dataclass(frozen=True)
class Measured:
    """A table row: the runtime that ran the whole processes faster on that kind (or torch
    where none was measured), what the figures said, and the docs/embeddings.md section
    holding them ("" where nothing was measured)."""

    runtime: str  # "torch" | "openvino"
    finding: str
    section: str = ""


AUTO_SECTION = "Which runtime auto picks"
NOT_MEASURED = "OpenVINO on packed rows not measured on this kind"
# (kind, dtype) -> the runtime; every figure from whole processes (interpreter start, imports,
# the graph cache read and compiles included), 2,000 BBC texts, 2 threads.
RUNTIME_TABLE: dict[tuple[CpuKind, str], Measured] = {
    (CpuKind.AVX512_VNNI, "float32"): Measured("openvino", "1.09x torch as whole processes, graphs cached", AUTO_SECTION),
    (CpuKind.AVX512_VNNI, "int8"): Measured("openvino", "1.08-1.12x torch's int8 as whole processes, graphs cached, and closer to float32", AUTO_SECTION),
    (CpuKind.AVX2, "float32"): Measured("torch", NOT_MEASURED),
    (CpuKind.AVX2, "int8"): Measured("torch", "int8 needs VNNI: torch refuses it in one line"),
    (CpuKind.AMX, "float32"): Measured("torch", NOT_MEASURED),
    (CpuKind.AMX, "int8"): Measured("torch", NOT_MEASURED),
}  # fmt: skip


# The server's batches range from one request to a full queue: OpenVINO ran /embed at 0.73x
# torch's rate at saturation and 12x its median latency at half load (each new row shape
# compiled while requests wait; small batches no faster than torch's), and its int8 needs a
# batch command's input to calibrate on. Measured in docs/embeddings.md's AUTO_SECTION.
SERVED_BY_TORCH = "the server runs torch: OpenVINO served /embed at 0.73x its rate (docs/embeddings.md)"


@dataclass(frozen=True)
class RuntimeChoice:
    runtime: str  # "torch" | "openvino"
    why: str  # one line for the user ("" where the runtime was given, not chosen)


def choose_runtime(
    kind: CpuKind, dtype: str, task: str, device: str = "cpu", *, ray: bool = False, compiled: bool = False,
    openvino_installed: bool = True, serving: bool = False,
) -> RuntimeChoice:  # fmt: skip
    """auto's decision for a `task` folder ("embedding", "classification", ...) run in `dtype`
    on `device` of `kind`: the table's runtime where OpenVINO can run it, else torch.
    serving: for the server, which runs torch (SERVED_BY_TORCH)."""
    from packed_transformers.inference.openvino_graphs import OPENVINO_TASKS

    fallback = None
    if device != "cpu":
        fallback = f"the device is {device}"
    elif ray:
        fallback = "Ray's replicas run torch"
    elif compiled:
        fallback = "--compile compiles torch's forward"
    elif task not in OPENVINO_TASKS:
        fallback = f"OpenVINO runs {' and '.join(OPENVINO_TASKS)} folders, not {task}"
    elif serving:
        fallback = SERVED_BY_TORCH
    if fallback:
        return RuntimeChoice("torch", f"--runtime auto: torch ({fallback})")
    measured = RUNTIME_TABLE.get((kind, dtype))
    if measured is None:
        return RuntimeChoice("torch", f"--runtime auto: torch ({kind.value}, {dtype}: not measured)")
    if measured.runtime == "openvino" and not openvino_installed:
        return RuntimeChoice(
            "torch", f"--runtime auto: torch (OpenVINO, measured faster on {kind.value}, is not installed)"
        )
    where = f"; docs/embeddings.md, '{measured.section}'" if measured.section else ""
    return RuntimeChoice(
        measured.runtime,
        f"--runtime auto: {measured.runtime} ({kind.value}, {dtype}: {measured.finding}{where})",
    )


def resolved_runtime(
    runtime: str, task: str, device: str, dtype: str, *, ray: bool = False, compiled: bool = False,
    serving: bool = False,
) -> RuntimeChoice:  # fmt: skip
    """`runtime` as given (why ""), or for "auto" this machine's choice (`choose_runtime`)."""
    if runtime != AUTO:
        return RuntimeChoice(runtime, "")
    import importlib.util

    installed = importlib.util.find_spec("openvino") is not None and (
        dtype != "int8" or importlib.util.find_spec("nncf") is not None
    )
    return choose_runtime(
        this_cpu_kind(), dtype, task, device, ray=ray, compiled=compiled, openvino_installed=installed,
        serving=serving,
    )  # fmt: skip
