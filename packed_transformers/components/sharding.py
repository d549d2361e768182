"""FSDP2 for a training run (pretraining's `execution.sharding: fsdp`, fine-tuning's
`execution.sharding: fsdp` through components.replicas): the model's parameters, gradients
and optimizer state split over the replicas instead of copied on each, and checkpoints through
torch.distributed.checkpoint (DCP), which a run of another number of ranks reads (resharded).

    shard_model        fully_shard per block (the classes transformers names in
                       `_no_split_modules`: a decoder layer), then the whole model; gradients
                       summed over ranks (divide factor 1: the run's loss is already divided
                       by the step's predicted tokens of every rank, as the DDP path's is)
    shards_writer      the writer of dcp/ (every rank's shard of model and optimizer) for the
                       one checkpoint writer (components.checkpoint); training_state.pt then
                       holds no optimizer, model/ the weights gathered whole (what a user loads)
    load_sharded       dcp/ into this run's shards, whatever number of ranks wrote it
    materialize_sharded  a model built on the meta device and sharded gets its weights: each
                       rank allocates its shards only, rank 0's whole model broadcast into them
    load_full_optimizer_state
                       an unsharded checkpoint's optimizer state into shards (any job resuming
                       one on sharded ranks)
    with_spare_forwards  an evaluation's batches, then uncounted ones, to as many forwards as the
                       busiest rank runs (every job's evaluation under FSDP2)

Gloo runs every collective FSDP2 and DCP need, so all of this runs and is tested on CPUs
(tests/training/test_decoder_fsdp.py). Never imports the run or the engines.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from packed_transformers.components import checkpoint as ckpt
from packed_transformers.components.errors import RunError


def with_spare_forwards(batches: list, most: int, spare) -> list[tuple[object, bool]]:
    """(batch, counted) for each of this rank's evaluation `batches`, counted, then `spare`
    uncounted up to `most` forwards: FSDP2 gathers each block's parameters in every forward,
    so every rank runs as many forwards as the rank with the most batches (`most`), and a rank
    short of batches repeats one whose outputs count for nothing."""
    return [(batch, True) for batch in batches] + [(spare, False)] * max(most - len(batches), 0)


def block_modules(model, key: str = "execution.sharding") -> list[torch.nn.Module]:
    """The model's repeated blocks, what FSDP2 shards one by one: modules whose class transformers
    names unsplittable (`_no_split_modules` of the model, or of the transformers model it wraps
    as `hf_model`: what accelerate's device maps keep whole); for a model that names none (the
    packed BERT heads), the children of its ModuleList holding the most parameters (its layers).
    key: the config key a refusal names."""
    named = getattr(model, "_no_split_modules", None) or getattr(
        getattr(model, "hf_model", None), "_no_split_modules", None
    )
    names = set(named or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    if not lists:
        raise RunError(
            f"{key} fsdp: {type(model).__name__} names no block to shard and has no list of blocks"
        )
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def shard_model(model, world: int, precision: str, device: torch.device, blocks=None) -> int:
    """fully_shard each block (default: those of `model.hf_model`, block_modules; BERT gives its
    encoder layers), then `model`; returns the number of blocks. bf16 on CUDA gathers
    parameters in bf16 and reduces gradients in fp32 (MixedPrecisionPolicy); on a CPU the run's
    bf16 (or fp16) autocast does the casting and the shards stay fp32."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if world < 2:
        raise RunError("execution.sharding fsdp: needs 2 or more processes (torchrun --nproc-per-node N)")
    policy = MixedPrecisionPolicy()
    if precision == "bf16" and device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = block_modules(model.hf_model) if blocks is None else list(blocks)
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # a sum: the loss is already the step's mean; a plain SUM collective (gloo has no
            # PREMUL_SUM, which a divide factor alone would ask for)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return len(blocks)


def materialize_sharded(model, whole_hf_model, device: torch.device, rank: int) -> None:
    """Give a model built on the meta device and sharded (shard_model) its weights: each rank
    allocates only its shards (`to_empty`), and rank 0's `whole_hf_model` (built on the CPU as an
    unsharded run builds it, same seed: None on the other ranks) is broadcast into them, so a
    sharded run starts from the weights a one-process run starts from, and no rank but rank 0
    ever holds the whole model (in host memory, once). Buffers that are not in the state dict
    (rotary frequencies) are broadcast as they are."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    hf_model = model.hf_model
    model.to_empty(device=device)
    whole = whole_hf_model.state_dict() if rank == 0 else {}
    set_model_state_dict(
        hf_model,
        whole,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True),
    )
    sources = dict(whole_hf_model.named_buffers()) if rank == 0 else {}
    for name, buffer in hf_model.named_buffers():
        value = sources[name].to(device) if rank == 0 else torch.empty_like(buffer)
        dist.broadcast(value, src=0)
        buffer.copy_(value)


def load_full_optimizer_state(optimizer, state: dict) -> None:
    """An unsharded optimizer state (an unsharded run's checkpoint, or one from before sharded
    runs wrote dcp/, when they gathered it whole) into an
    optimizer over sharded parameters: each state tensor shaped like its parameter becomes that
    parameter's shard (the same placements), scalars stay as they are."""
    from torch.distributed.tensor import distribute_tensor

    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    state = {**state, "state": {index: dict(values) for index, values in state["state"].items()}}
    for index, per_parameter in state["state"].items():
        parameter = parameters[int(index)]
        for key, value in per_parameter.items():
            if (
                hasattr(parameter, "device_mesh")
                and torch.is_tensor(value)
                and value.shape == parameter.shape
            ):
                per_parameter[key] = distribute_tensor(
                    value.to(parameter.to_local().device), parameter.device_mesh, parameter.placements
                )
    optimizer.load_state_dict(state)


def shards_writer(hf_model, optimizer):
    """The writer of a sharded run's dcp/ (a collective every rank calls from the one checkpoint
    writer, components.checkpoint.save_checkpoint): every rank's shard of the model and the
    optimizer, by their names, so any number of ranks reads them back resharded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def write_shards(folder: Path) -> None:
        model_state, optimizer_state = get_state_dict(hf_model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder / "dcp")

    return write_shards


def has_shards(path: Path) -> bool:
    """Whether the checkpoint at `path` keeps its model and optimizer as DCP shards (dcp/)."""
    return (path / "dcp" / ".metadata").is_file()


def load_sharded(path: Path, hf_model, optimizer) -> None:
    """The model's and optimizer's state from `path`/dcp (CheckpointError if there is none),
    read resharded into this run's parameters: shards under FSDP2, whole tensors on one
    process or DDP's replicas."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not has_shards(path):
        raise ckpt.CheckpointError(f"{path}: no dcp/ (written by a run without execution.sharding fsdp)")
    model_state, optimizer_state = get_state_dict(hf_model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path / "dcp")
    set_state_dict(hf_model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
