"""Backends: torch (CPU, CUDA, torchrun DDP), torch pipeline (execution.layers_per_stage with
more than one stage) and ipu (PopTorch, imported only when selected)."""

from __future__ import annotations

import sys
from pathlib import Path

from training.build import RunError


def run(config: dict, output: Path, resume: bool) -> int:
    """Dispatch on execution.device; user-input errors become exit code 2 with one line."""
    try:
        if config["execution"]["device"] in ("ipu", "ipu-model"):
            from training.backends.ipu import run_ipu

            return run_ipu(config, output, resume)
        split = config["execution"]["layers_per_stage"]
        if split is not None and len(split) > 1:
            from training.backends.pipeline import run_pipeline

            return run_pipeline(config, output, resume)
        from training.loop import run_training

        return run_training(config, output, resume)
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        shut_down_process_group()


def shut_down_process_group() -> None:
    """Tear torch.distributed down before the interpreter exits. Left to interpreter
    shutdown, a gloo group's threads can outlive it: seen once as 'terminate called without
    an active exception' (SIGABRT) in a finished 2-stage pipeline run on a loaded machine."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
