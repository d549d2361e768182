"""What a run needs on this machine before it starts, all of it at once: the packed data,
the starting checkpoint, the device. A run missing three of them used to say so one
attempt at a time (the data, then CUDA, then the phase-1 checkpoint)."""

from __future__ import annotations

from pathlib import Path

HOW_TO = {
    "data": "create and pack the data first (docs/mlperf.md, steps 1, 2 and 4)",
    "checkpoint": "convert the phase-1 checkpoint first (docs/mlperf.md, step 3)",
}


def missing_prerequisites(config: dict) -> list[str]:
    """One phrase per thing this run needs and this machine lacks (empty: ready)."""
    missing = []
    data = config["data"]
    if not data.get("synthetic"):
        for key in ("train_dir", "eval_dir"):
            folder = data.get(key)
            if folder is not None and not (Path(folder) / "metadata.json").is_file():
                missing.append(f"data.{key} {folder}: no packed data there ({HOW_TO['data']})")
    checkpoint = config["model"].get("init_checkpoint")
    if checkpoint and not (Path(checkpoint) / "config.json").is_file():
        missing.append(
            f"model.init_checkpoint {checkpoint}: no Hugging Face folder there ({HOW_TO['checkpoint']})"
        )
    if config["execution"]["device"] == "cuda":
        import torch

        if not torch.cuda.is_available():
            from packed_transformers.common.cli import no_gpu

            missing.append(no_gpu("execution.device cuda", torch.__version__, torch.version.cuda is not None))
    return missing


def prerequisites_line(config_path: str, missing: list[str]) -> str:
    """The one error line naming every missing prerequisite (and docs/mlperf.md for MLPerf configs)."""
    where = " See docs/mlperf.md." if "mlperf" in Path(config_path).name else ""
    return f"{config_path}: {len(missing)} prerequisite(s) missing: " + "; ".join(missing) + "." + where
