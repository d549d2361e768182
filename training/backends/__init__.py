"""Engines, side by side; each implements training.backends.engine.Engine and none
imports the run (training.run), which drives them all:

    torch_engine   CPU, CUDA, torchrun DDP replicas
    pipeline       execution.layers_per_stage with more than one stage (x replicas), torch
    ipu            Graphcore IPUs through PopTorch (imported only when selected)
"""

from __future__ import annotations

import sys
from pathlib import Path

from common.files import describe_os_error
from training.distributed import shut_down_process_group
from training.errors import RunError


def engine_class(config: dict):
    """The engine a config selects (importing only that engine's dependencies)."""
    if config["execution"]["device"] in ("ipu", "ipu-model"):
        from training.backends.ipu import IpuEngine, require_poptorch

        require_poptorch(config["execution"]["device"])  # before any data is read
        return IpuEngine
    split = config["execution"]["layers_per_stage"]
    if split is not None and len(split) > 1:
        from training.backends.pipeline import PipelineEngine

        return PipelineEngine
    from training.backends.torch_engine import TorchEngine

    return TorchEngine


def run(config: dict, output: Path, resume: bool) -> int:
    """The run with the selected engine; user-input errors become exit code 2 with one line."""
    from training.run import run_training

    try:
        return run_training(config, output, resume, engine_class(config))
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, an unwritable or misplaced output folder, ...
        print(f"error: {describe_os_error(err)}", file=sys.stderr)
        return 2
    finally:
        shut_down_process_group()
