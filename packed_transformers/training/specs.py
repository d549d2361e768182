"""The pretraining jobs `run_pretraining.py` (`packed pretrain`) runs, one registered spec each:
BERT phase 2 and decoder pretraining. The command reads the YAML once and picks the spec once,
by what the config names (a `model.family`: a decoder); everything after asks the spec, never
the config again.

    spec = spec_of(raw)                       # "bert" | "decoder"
    config = spec.load_config(raw, sets, source, compile_only)   # ConfigError: one line
    spec.run(config, output, resume)          # the process exit code

What differs between the jobs is a field here (what --compile-only and --plan mean for it, what
it checks of this machine first), not a branch in the command. Imports nothing heavy: each
function imports its job's modules when called, so the config is checked before torch loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PretrainingSpec:
    """One pretraining job: its name (and title), how its config is resolved and checked (raw YAML, the
    --set assignments, the file's name for messages, --compile-only; ConfigError), what the
    command checks of this machine before the run (config, config file -> a refusal line or
    None), its run (config, output folder, --resume -> exit code) and its memory plan
    (config, source, GPUs, GiB per GPU -> exit code; None: the job has none)."""

    name: str
    title: str  # what a message calls it
    load_config: Callable[[dict, list, str, bool], dict]
    preflight: Callable[[dict, str], str | None]
    run: Callable[[dict, Path, bool], int]
    plan: Callable[[dict, str, int, float], int] | None = None


def _bert_config(raw: dict, assignments: list, source: str, compile_only: bool) -> dict:
    from packed_transformers.training.config import validate_raw

    return validate_raw(
        raw, list(assignments) + (["execution.compile_only=true"] if compile_only else []), source
    )


def _decoder_config(raw: dict, assignments: list, source: str, compile_only: bool) -> dict:
    from packed_transformers.training.config import ConfigError
    from packed_transformers.training.decoder.config import load_decoder_config

    if compile_only:
        raise ConfigError(
            "--compile-only: only PopTorch compiles ahead of time; a decoder runs on cpu or cuda"
        )
    return load_decoder_config(raw, assignments, source)


def _bert_preflight(config: dict, source: str) -> str | None:
    """Two or more prerequisites missing: all named in one line before any data is opened (one
    alone is the run's own precise message; an IPU config first needs poptorch, which the IPU
    engine's check_config names before anything else)."""
    from packed_transformers.training.prerequisites import missing_prerequisites, prerequisites_line

    missing = missing_prerequisites(config)
    if len(missing) >= 2 and config["execution"]["device"] in ("cpu", "cuda"):
        return prerequisites_line(source, missing)
    return None


def _no_preflight(config: dict, source: str) -> None:
    return None


def _bert_run(config: dict, output: Path, resume: bool) -> int:
    from packed_transformers.training.run import run

    return run(config, output, resume)


def _decoder_run(config: dict, output: Path, resume: bool) -> int:
    from packed_transformers.training.decoder.run import run_decoder

    return run_decoder(config, output, resume)


def _decoder_plan(config: dict, source: str, gpus: int, gpu_gib: float) -> int:
    from packed_transformers.training.decoder.memory_plan import print_plan

    return print_plan(config, source, gpus, gpu_gib)


SPECS = {
    "bert": PretrainingSpec("bert", "BERT", _bert_config, _bert_preflight, _bert_run),
    "decoder": PretrainingSpec(
        "decoder", "decoder", _decoder_config, _no_preflight, _decoder_run, _decoder_plan
    ),
}


def spec_of(raw) -> PretrainingSpec:
    """The job a raw config asks for: a decoder where its model section names a family."""
    from packed_transformers.training.decoder.config import is_decoder_config

    return SPECS["decoder" if is_decoder_config(raw) else "bert"]
