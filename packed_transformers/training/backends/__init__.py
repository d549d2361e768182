"""Engines, side by side; each implements training.backends.engine.Engine and none
imports the run (training.run), which drives them all:

    torch_engine   CPU, CUDA, torchrun DDP replicas
    pipeline       execution.layers_per_stage with more than one stage (x replicas), torch
    ipu            Graphcore IPUs through PopTorch (poptorch imported only when selected)
"""

from __future__ import annotations


def engine_class(config: dict):
    """The engine class a config selects (importing only that engine's module)."""
    if config["execution"]["device"] in ("ipu", "ipu-model"):
        from packed_transformers.training.backends.ipu import IpuEngine

        return IpuEngine
    split = config["execution"]["layers_per_stage"]
    if split is not None and len(split) > 1:
        from packed_transformers.training.backends.pipeline import PipelineEngine

        return PipelineEngine
    from packed_transformers.training.backends.torch_engine import TorchEngine

    return TorchEngine
