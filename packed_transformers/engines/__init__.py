"""The engines: what turns a job's micro-batches into optimizer steps, below every run that
trains (BERT pretraining, the decoder's run, every fine-tuning task), so that each imports them:

    torch_engine   CPU, CUDA; DDP or FSDP2 under torchrun. `TorchEngine`: every job's engine on
                   torch (BERT's through `attach`, the decoder's and fine-tuning's through `place`
                   with their optimizer); its `TorchStep` takes the step (take_step with the job's
                   loss) and saves and restores its state in one format
    pipeline       BERT over execution.layers_per_stage with more than one stage (x replicas)
    ipu            BERT on Graphcore IPUs through PopTorch (ipu_plan: the plan; ipu_step: the
                   step's graph); poptorch is imported only inside ipu.py's functions
    engine         the interface a run asks of its engines (`Engine`: `step(micro_batches, loss,
                   lr)` -> `StepResult`; `Snapshot`; `PretrainingLoss`, which the pipeline and IPU
                   engines stage alone: the decoder and fine-tuning run on the torch engine, their
                   configs naming no other device or stages)

The step's arithmetic every engine shares is components/step.py. Never imports training/,
finetune/ or any room above them; the torch, pipeline and IPU engines never import one another.
"""

from __future__ import annotations


def engine_class(config: dict):
    """The engine class a config selects (importing only that engine's module)."""
    if config["execution"]["device"] in ("ipu", "ipu-model"):
        from packed_transformers.engines.ipu import IpuEngine

        return IpuEngine
    split = config["execution"]["layers_per_stage"]
    if split is not None and len(split) > 1:
        from packed_transformers.engines.pipeline import PipelineEngine

        return PipelineEngine
    from packed_transformers.engines.torch_engine import TorchEngine

    return TorchEngine
