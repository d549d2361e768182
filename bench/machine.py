"""What a bench ran on, for the tables in docs/: CPU model, the vector-instruction flags that
decide the kernels torch picks, cores, torch's version, the ISA limits in force, date, commit."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu() -> dict:
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"model": model, "flags": [f for f in FLAGS if f in flags], "cores": os.cpu_count()}


def description() -> dict:
    import torch

    repo = Path(__file__).resolve().parent.parent
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout
    limits = {k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS") if k in os.environ}
    # a smoke's model in place of the MiniLM asset (data/assets.py): its figures are not MiniLM's
    model = {"model": os.environ["PACKED_ASSET_MODEL"]} if os.environ.get("PACKED_ASSET_MODEL") else {}
    # ATen's kernel level as torch reports it (ATEN_CPU_CAPABILITY and the CPU decide it)
    return {"cpu": cpu(), "torch": torch.__version__, "isa_limits": limits,
            "aten_capability": torch.backends.cpu.get_cpu_capability(), "date": time.strftime("%Y-%m-%d"),
            "commit": commit.strip(), **model}  # fmt: skip


def line(info: dict) -> str:
    c = info["cpu"]
    limits = ", ".join(f"{k}={v}" for k, v in info["isa_limits"].items()) or "no ISA limit"
    return (f"{c['model']} ({', '.join(c['flags']) or 'no AVX2'}), {c['cores']} cores, torch {info['torch']} "
            f"(ATen {info['aten_capability']}), {limits}, {info['date']}, commit {info['commit']}")  # fmt: skip
