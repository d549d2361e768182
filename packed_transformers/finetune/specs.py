"""The fine-tuning jobs `packed train` runs, one registered spec per data.task: classification
(single or multi-label), question answering, a decoder's supervised fine-tuning, contrastive
embedding training and rerankers. The command picks the spec once and hands it on:

    spec = spec_for(config)                   # SPECS[data.task]
    spec.run(config, output, resume, stop, overwrite, spec)   # -> the run's summary

What differs between the tasks is a field here: the data sources it reads (the config check's
table), its input's reader (finetune.jobs), its trainer (the one Trainer, finetune.train; a
reranker's: sentence-transformers' CrossEncoderTrainer). Standard library only (the config
check reads it before torch loads); each function imports its task's modules when called.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FinetuneSpec:
    """One fine-tuning job: its data.task, the data.source values it reads, the reader of its
    input ((config, the checkpoint's config.json as read) -> finetune.job_contract.JobInput;
    None: its trainer reads its own) and its run ((config, output folder, resume, stop,
    overwrite, this spec) -> the summary dict; None on a torchrun rank but the first)."""

    name: str
    sources: tuple[str, ...]
    read_input: Callable[[dict, dict | None], object] | None
    run: Callable[..., dict | None]


def _lazy(module: str, name: str) -> Callable:
    """`module.name`, imported when first called (vLLM's lazy registry): the config check reads
    this table before torch loads."""

    def call(*args):
        return getattr(importlib.import_module(f"packed_transformers.{module}"), name)(*args)

    return call


def _rerank(config: dict, output: Path, resume: bool, stop, overwrite: bool, spec: FinetuneSpec):
    from packed_transformers.hf_integration.rerank_train import run_rerank  # the spec is the ST trainer's

    return run_rerank(config, output, resume, stop, overwrite)


_TRAINER = _lazy("finetune.train", "run_finetune")  # the one Trainer's job (finetune.train.Run)
SPECS: dict[str, FinetuneSpec] = {
    spec.name: spec
    for spec in (
        FinetuneSpec(
            "classification", ("jsonl", "bbc_news"), _lazy("finetune.jobs", "classification_job"), _TRAINER
        ),
        FinetuneSpec("question_answering", ("squad",), _lazy("finetune.jobs", "qa_job"), _TRAINER),
        FinetuneSpec("causal_lm", ("jsonl",), _lazy("finetune.causal_lm_task", "causal_lm_job"), _TRAINER),
        FinetuneSpec("embedding", ("jsonl",), _lazy("finetune.jobs", "contrastive_job"), _TRAINER),
        FinetuneSpec("rerank", ("jsonl",), None, _rerank),
    )
}
TASKS = tuple(SPECS)  # data.task's choices


def spec_for(config: dict) -> FinetuneSpec:
    """The job a checked config asks for (its data.task, one of TASKS)."""
    return SPECS[config["data"]["task"]]
