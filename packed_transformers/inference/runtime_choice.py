"""`--runtime auto`: which runtime runs the packed rows on this CPU, read from a table of
whole-process measurements (start-up included), one row per CPU kind and dtype.

    choice = choose_runtime(CpuKind.AVX512_VNNI, "float32", "embedding")   # pure
    choice.runtime, choice.why      # "openvino", "--runtime auto: openvino (AVX-512 with VNNI, float32: ...)"
    resolved_runtime("auto", "embedding", "cpu", "int8")    # the same, for this machine's kind

The candidates are torch eager, torch.compile, OpenVINO and ONNX Runtime on packed rows.
torch.compile lost to eager once its compile time counts (docs/embeddings.md, "torch.compile
at the pack widths"). OpenVINO ran packed rows faster than torch on the AVX-512/VNNI kind
(float32 and int8); ONNX Runtime's dynamic int8 on packed rows is the int8 that holds the
quality gate on the AVX2 kind, where torch's and OpenVINO's int8 are refused (docs/embeddings.md,
"ONNX Runtime on packed rows and the torch-free process"). A kind or dtype where no graph
runtime was measured faster gets torch, the default, and says so.

Decided here, once, for every door (embed, predict, the server, `packed_encode`): the kind
comes from the CPU's flags (`cpu_kind`, pure), the table gives the runtime, and anything a graph
runtime does not run (another task than a pooled head, a GPU, bfloat16, Ray's replicas,
torch.compile, its package not installed, the server) falls back to torch with the reason in
`why`. auto is not the default: the vectors would then depend on the machine (each runtime's
int8 is another quantization), and the first process of a graph runtime exports or converts
the model (10-17 s for MiniLM-L6) that its graph cache saves later ones.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from packed_transformers.common.choices import GRAPH_RUNTIMES, GRAPH_TASKS

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


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This machine's CPU flags (its first processor's; none where they cannot be read)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# the instructions that multiply int8 by int8 into int32 in one step (AVX-512 VNNI, AVX-VNNI, AMX)
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def has_vnni(flags: frozenset[str]) -> bool:
    return any(flag in flags for flag in VNNI_FLAGS)


# The refusals this CPU's flags alone decide, each written once: the commands' preflight says
# them before torch is imported (machine_refusal); inference.int8, inference.precision and
# inference.openvino_graphs say the same where a caller reaches them from Python.
INT8_WITHOUT_VNNI = (
    "--dtype int8: this CPU has no VNNI (AVX512-VNNI, AVX-VNNI or AMX); without it int8 needs "
    "7-bit activations, which lose accuracy (docs/embeddings.md) (use --dtype float32, or "
    "--runtime onnxruntime --dtype int8)"
)
BF16_FLAGS = ("avx512_bf16", "amx_tile")  # what torch.cpu's bf16 checks read
BF16_WITHOUT_INSTRUCTIONS = (
    "--dtype bfloat16: this CPU has no bf16 instructions (AVX512-BF16 or AMX); bf16 would be emulated, "
    "slower than float32 (use --dtype float32)"
)
OPENVINO_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # what OpenVINO's CPU plugin computes bf16 with
OPENVINO_BF16_WITHOUT_INSTRUCTIONS = (
    "--runtime openvino --dtype bfloat16 needs a CPU that computes bf16 (AVX512_BF16 or AMX); "
    "this one would emulate it, slower than float32 (use --dtype float32 or int8)"
)


def openvino_computes_bf16(flags: frozenset[str]) -> bool:
    return any(flag in flags for flag in OPENVINO_BF16_FLAGS)


# Measured on an AVX2 EPYC (docs/embeddings.md, "The AVX2 kind"): NNCF's static int8 through
# OpenVINO ran slower than OpenVINO's float32 and fell below the quality gate (min cosine 0.958
# to sentence-transformers on 1,000 texts, where ONNX Runtime's dynamic int8 keeps 0.98).
OPENVINO_INT8_WITHOUT_VNNI = (
    "--runtime openvino --dtype int8: on a CPU without VNNI OpenVINO's int8 measured slower than its float32 "
    "and below the quality gate (docs/embeddings.md); use --runtime onnxruntime --dtype int8"
)


def machine_refusal(
    runtime: str, device: str, dtype: str, task: str = "embedding", flags=None, serving: bool = False
) -> str | None:
    """The one line for `--runtime/--device/--dtype` that this CPU cannot run as asked, decided
    from its flags alone (no torch, no model), or None. auto: what it would choose (for the
    server where `serving`). A GPU's questions (bf16 there, CUDA present) need torch and are
    asked later."""
    if device != "cpu":
        return None
    flags = cpu_flags() if flags is None else frozenset(flags)
    chosen = (
        resolved_runtime(runtime, task, device, dtype, serving=serving).runtime
        if runtime == AUTO
        else runtime
    )
    if dtype == "int8" and not has_vnni(flags):
        return {"torch": INT8_WITHOUT_VNNI, "openvino": OPENVINO_INT8_WITHOUT_VNNI}.get(chosen)
    if dtype == "bfloat16" and chosen == "torch" and not any(flag in flags for flag in BF16_FLAGS):
        return BF16_WITHOUT_INSTRUCTIONS
    return None


def arguments_refusal(args, ray: bool = False, serving: bool = False) -> str | None:
    """machine_refusal for a command's parsed `args` (model, runtime, device, dtype), or None.
    Not for --ray (its replicas are other machines) nor an exported folder (its export settled
    runtime and dtype)."""
    from packed_transformers.common.choices import EXPORTED

    if ray or (Path(args.model) / EXPORTED).is_file():
        return None
    return machine_refusal(args.runtime, args.device, args.dtype, serving=serving)


def exit_on_machine_refusal(args, ray: bool = False) -> None:
    """A command's preflight (embed, predict): arguments_refusal's line on stderr and exit 2,
    before torch is imported."""
    import sys

    refusal = arguments_refusal(args, ray)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        raise SystemExit(2)


def this_cpu_kind(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuKind:
    """This machine's kind (its first processor's flags; OTHER where they cannot be read)."""
    return cpu_kind(cpu_flags(cpuinfo))


@dataclass(frozen=True)
class Measured:
    """A table row: the runtime that ran the whole processes faster on that kind (or torch
    where none was measured), what the figures said, and the docs/embeddings.md section
    holding them ("" where nothing was measured)."""

    runtime: str  # "torch" | "openvino" | "onnxruntime"
    finding: str
    section: str = ""


AUTO_SECTION = "Which runtime auto picks"
ONNX_SECTION = "ONNX Runtime on packed rows and the torch-free process (issue 93, 2026-12-01)"
NOT_MEASURED = "no graph runtime on packed rows measured on this kind"
# (kind, dtype) -> the runtime; every figure from whole processes (interpreter start, imports,
# the graph cache read and compiles included), 2,000 BBC texts, 2 threads.
RUNTIME_TABLE: dict[tuple[CpuKind, str], Measured] = {
    (CpuKind.AVX512_VNNI, "float32"): Measured("openvino", "1.09x torch as whole processes, graphs cached", AUTO_SECTION),
    (CpuKind.AVX512_VNNI, "int8"): Measured("openvino", "1.08-1.12x torch's int8 as whole processes, graphs cached, and closer to float32", AUTO_SECTION),
    (CpuKind.AVX2, "float32"): Measured("torch", "ONNX Runtime on packed rows ran the process at 0.96x torch's (its loop 0.91x), OpenVINO at 0.81x", ONNX_SECTION),
    (CpuKind.AVX2, "int8"): Measured("onnxruntime", "its dynamic int8 holds the quality gate without VNNI, 1.37x the torch-free ONNX Runtime int8 script's loop; torch's and OpenVINO's int8 are refused here", ONNX_SECTION),
    (CpuKind.AMX, "float32"): Measured("openvino", "1.03-1.07x torch as whole processes in every round, one bounded graph compiled in each", AUTO_SECTION),
    (CpuKind.AMX, "int8"): Measured("openvino", "1.20x and 1.23x torch's int8 as whole processes, graphs cached (0.44x quantizing), and closer to float32", AUTO_SECTION),
}  # fmt: skip


# The server's batches range from one request to a full queue. With a graph compiled per row
# shape OpenVINO ran /embed at 0.73x torch's rate at saturation and 12x its median latency at
# half load (each new shape compiled while requests waited: AVX-512 EPYC, 2026-11-29); its int8
# needs a batch command's input to calibrate on. One bounded graph (2026-12-06) was measured on
# the AMX kind only: the server runs torch wherever SERVED_TABLE has no row.
SERVED_BY_TORCH = "the server runs torch: OpenVINO served /embed at 0.73x its rate (docs/embeddings.md)"
SERVED_TABLE: dict[tuple[CpuKind, str], Measured] = {
    (CpuKind.AMX, "float32"): Measured("openvino", "served /embed at 1.08x torch's rate at saturation (1.07-1.12x paired), about half its median and lower p99 latency at 50% and 80% load, its graph compiled at start-up", AUTO_SECTION),
}  # fmt: skip


@dataclass(frozen=True)
class RuntimeChoice:
    runtime: str  # "torch" | "openvino" | "onnxruntime"
    why: str  # one line for the user ("" where the runtime was given, not chosen)


def choose_runtime(
    kind: CpuKind, dtype: str, task: str, device: str = "cpu", *, ray: bool = False, compiled: bool = False,
    installed: frozenset[str] = frozenset(GRAPH_RUNTIMES), serving: bool = False,
) -> RuntimeChoice:  # fmt: skip
    """auto's decision for a `task` folder ("embedding", "classification", ...) run in `dtype`
    on `device` of `kind`: the table's runtime where it can run the job and is `installed`
    (the graph runtimes whose packages are), else torch. serving: the server's choice, from
    SERVED_TABLE (the kinds its runtimes were measured on under load), else torch (SERVED_BY_TORCH)."""
    fallback = None
    if device != "cpu":
        fallback = f"the device is {device}"
    elif ray:
        fallback = "Ray's replicas run torch"
    elif compiled:
        fallback = "--compile compiles torch's forward"
    elif task not in GRAPH_TASKS:
        fallback = f"the graph runtimes run {' and '.join(GRAPH_TASKS)} folders, not {task}"
    elif serving and (kind, dtype) not in SERVED_TABLE:
        fallback = SERVED_BY_TORCH
    if fallback:
        return RuntimeChoice("torch", f"--runtime auto: torch ({fallback})")
    measured = (SERVED_TABLE if serving else RUNTIME_TABLE).get((kind, dtype))
    if measured is None:
        return RuntimeChoice("torch", f"--runtime auto: torch ({kind.value}, {dtype}: not measured)")
    if measured.runtime != "torch" and measured.runtime not in installed:
        return RuntimeChoice(
            "torch",
            f"--runtime auto: torch ({measured.runtime}, measured faster on {kind.value}, is not installed)",
        )
    where = f"; docs/embeddings.md, '{measured.section}'" if measured.section else ""
    return RuntimeChoice(
        measured.runtime,
        f"--runtime auto: {measured.runtime} ({kind.value}, {dtype}: {measured.finding}{where})",
    )


def installed_runtimes(dtype: str) -> frozenset[str]:
    """The graph runtimes whose packages are installed for `dtype` (found, not imported)."""
    import importlib.util

    found = {"onnxruntime"} if importlib.util.find_spec("onnxruntime") is not None else set()
    if importlib.util.find_spec("openvino") is not None and (
        dtype != "int8" or importlib.util.find_spec("nncf") is not None
    ):
        found.add("openvino")
    return frozenset(found)


def resolved_runtime(
    runtime: str, task: str, device: str, dtype: str, *, ray: bool = False, compiled: bool = False,
    serving: bool = False,
) -> RuntimeChoice:  # fmt: skip
    """`runtime` as given (why ""), or for "auto" this machine's choice (`choose_runtime`)."""
    if runtime != AUTO:
        return RuntimeChoice(runtime, "")
    return choose_runtime(
        this_cpu_kind(), dtype, task, device, ray=ray, compiled=compiled, installed=installed_runtimes(dtype),
        serving=serving,
    )  # fmt: skip
