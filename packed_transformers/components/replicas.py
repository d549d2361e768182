"""Replicas of a run whose step is one batch table (fine-tuning): torchrun's processes share
each step's rows, and N processes take the step one process takes.

    the step's rows        rank r trains rows r, r + N, ... of the step's batch table [B, K]
                           (one empty row where B < N: the batch shape a compiled run's padded
                           last batch has, which every model takes)
    the step's loss        sum over the step's loss units (examples, or predicted tokens) of
                           every rank / their count over every rank (engines.torch_engine.take_step:
                           units counted before compute, DDP's average multiplied back)
    the model              replicated (DDP) or sharded (`sharding: fsdp`: FSDP2 per block),
                           as every job's (engines.torch_engine.forward_of); rank 0 writes
                           every file
    checkpoints            model/ the weights whole (gathered where sharded); the optimizer
                           whole in training_state.pt, or (sharded) every rank's shards in dcp/
                           (engines.torch_engine.TorchStep.snapshot): any number of
                           ranks, sharded or not, resumes any checkpoint (TorchStep.restore)

One process is a `Replicas` of world 1: every method is then the plain single-process
step, bit for bit. Never imports the runs (training/, finetune/).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from packed_transformers.components.distributed import (
    ONE_PROCESS,
    Replicas,
    join_process_group,
)
from packed_transformers.components.errors import RunError


def join_replicas(device_kind: str, sharding: str, threads: int | None) -> Replicas:
    """This process's Replicas from torchrun's environment (world 1 without it); FSDP2 needs
    2 or more processes (RunError, one line)."""
    replicas = join_process_group(device_kind, threads, None, "execution.device")
    if sharding == "fsdp" and replicas.world < 2:
        raise RunError("execution.sharding fsdp: needs 2 or more processes (torchrun --nproc-per-node N)")
    return dataclasses.replace(replicas, sharding=sharding)


def host_skeleton(model: torch.nn.Module, replicas: Replicas) -> torch.nn.Module | None:
    """Rank 0 of a sharded run: a copy of `model` (before sharding) whose parameters hold no
    memory (meta), its buffers real; `whole_model` fills it with the gathered weights for the
    run's final save. None elsewhere."""
    if not (replicas.sharded and replicas.writes):
        return None
    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
            for p in model.parameters()}  # fmt: skip
    return copy.deepcopy(model, memo)


def _tied_names(model: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor (tied embeddings), first name first."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def gathered_weights(model: torch.nn.Module, replicas: Replicas) -> dict[str, torch.Tensor] | None:
    """Collective under FSDP2: the whole state dict on rank 0's CPU (None on the others), a tied
    tensor under its first name only (as safetensors keeps it). Unsharded: None (the model,
    whole on every rank, is saved as it is)."""
    if not replicas.sharded:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not replicas.writes:
        return None
    for names in _tied_names(model):
        for alias in names[1:]:
            full.pop(alias, None)
    return full


def load_weights(
    model: torch.nn.Module, weights: dict[str, torch.Tensor], replicas: Replicas, assign: bool = False
) -> None:
    """A checkpoint's whole weights (every rank reads them) into `model`, strictly: every name
    but a tied alias the file keeps once, no other. Sharded: each rank takes its shards."""
    for names in _tied_names(model):
        present = [n for n in names if n in weights]
        for alias in names:
            if present and alias not in weights:
                weights[alias] = weights[present[0]]
    if not replicas.sharded:
        model.load_state_dict(weights, strict=True, assign=assign)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=True))


def whole_model(skeleton: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """host_skeleton's copy given the gathered weights (rank 0): an unsharded model on the CPU
    (its meta parameters replaced by the weights; a tied pair shares one tensor)."""
    load_weights(skeleton, dict(weights), ONE_PROCESS, assign=True)
    return skeleton
