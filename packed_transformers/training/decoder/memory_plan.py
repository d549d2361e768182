"""`run_pretraining.py --config C --plan --gpus N --gpu-memory-gib G`: the memory one rank of a
decoder pretraining run needs, worked out before anything is allocated, and how many GPUs of
a given memory the config needs.

    weights, gradients, AdamW state    fp32, 4 + 4 + 8 bytes a parameter: on every rank without
                                       sharding, a 1/N share of each with execution.sharding fsdp
    gathered (fsdp only)               what FSDP2 holds unsharded while it computes: the root's
                                       own parameters (embeddings, final norm, LM head; kept
                                       unsharded from forward to backward), two blocks (the one
                                       running and the one prefetched) in the compute dtype, and
                                       the fp32 copy of one block's gradient for the reduce-scatter
    activations                        measured: the run's own step (engines.torch_engine.take_step:
                                       forward, backward, the optimizer) of the config's
                                       micro-batch (rows x S tokens) run on fake tensors (torch's
                                       FakeTensorMode: shapes and dtypes, no memory) under the
                                       run's precision, the live bytes tracked (LiveBytes), with
                                       and without activation checkpointing; with fsdp the model
                                       in the compute dtype and each gradient dropped once made
                                       (FSDP2 reduce-scatters it into the rank's share)

Without sharding the whole fake step is tracked (two micro-batches where the run accumulates,
so that gradients held between them are counted): the plan is its peak. Attention is counted
as one document filling each row (the concatenated layout, and the documents layout's worst
case) through transformers' SDPA; the packed run's buckets hold no more. A plan fits a GPU
when its total is at most 90% of the GPU's memory: the rest is for the CUDA context, NCCL's
buffers and the allocator's fragmentation.

tests/training/test_memory_plan.py checks a plan against the peak memory of a real step at a
small shape (within 10%).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from packed_transformers.components.errors import RunError

USABLE_FRACTION = 0.9  # of a GPU's memory, for the plan's total (module docstring)
GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # what `needed` tries, smallest first
GIB = 2**30


@dataclass(frozen=True)
class StepMemory:
    """Bytes at the peak of one fake training step of a whole (unsharded) model."""

    parameters: int  # count
    root_parameters: int  # count: those outside the repeated blocks (embeddings, norm, head)
    block_parameters: int  # count: the largest block's
    peak: int  # the whole step's peak, every category
    gradients: int  # gradients held at that peak
    activations: int  # activations and temporaries at that peak


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds at its peak (module docstring's rows)."""

    weights: int
    gradients: int
    optimizer: int
    gathered: int
    activations: int
    total: int


def planned_model_config(config: dict, vocab_size: int | None):
    """The transformers config of the model the run would build: the starting folder's
    (config.json read once), or the config's shape (vocab_size: model.vocab_size, else the
    rows' metadata.json; None: neither says, RunError)."""
    from pathlib import Path

    from transformers import AutoConfig

    from packed_transformers.training.decoder.model import (
        decoder_folder_config,
        family_settings,
        set_rope_theta,
    )

    model_cfg = config["model"]
    if model_cfg["init_checkpoint"] is not None:
        settings = dict(decoder_folder_config(Path(model_cfg["init_checkpoint"])))
        return AutoConfig.for_model(settings.pop("model_type"), **settings)
    if vocab_size is None:
        raise RunError(
            "model.vocab_size: --plan needs the vocabulary; set model.vocab_size, or give data.train_dir's rows"
        )
    length = config["data"]["max_sequence_length"]
    family_config = AutoConfig.for_model(
        model_cfg["family"], **family_settings(model_cfg, vocab_size, length)
    )
    set_rope_theta(family_config, model_cfg["rope_theta"])
    return family_config


class LiveBytes:
    """Bytes of every tensor storage alive, and their peak, over the ops run inside it (a
    TorchDispatchMode: each op's outputs' storages counted once, until freed). The storages of
    `held` (the model's parameters, AdamW's state) count from the start, and a view of one
    (a weight transposed for a matmul) adds nothing. One pass over each op's outputs: torch's
    MemTracker, which also sorts the bytes by kind, walks every live tensor at every op
    (minutes for an 8B model at 8,192 tokens, against seconds here)."""

    def __init__(self, held, parameters=()):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        from torch.utils.weak import WeakIdKeyDictionary

        self.gradients_at_peak = 0  # bytes of `parameters`' gradients when the peak was reached
        counted = WeakIdKeyDictionary()  # storage -> bytes, each storage once
        for tensor in held:
            counted[tensor.untyped_storage()] = tensor.untyped_storage().nbytes()
        self.live = self.peak = self.baseline = sum(counted.values())
        tracker = self

        def freed(size: int) -> None:
            tracker.live -= size

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for leaf in tree_leaves(out):
                    if isinstance(leaf, torch.Tensor):
                        storage = leaf.untyped_storage()
                        if storage not in counted:
                            size = storage.nbytes()
                            counted[storage] = size
                            weakref.finalize(storage, freed, size)
                            tracker.live += size
                if tracker.live > tracker.peak:
                    tracker.peak = tracker.live
                    tracker.gradients_at_peak = sum(p.grad.nbytes for p in parameters if p.grad is not None)
                return out

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


@dataclass(frozen=True)
class ShapeLoss:
    """The plan's StepLoss (components.step): transformers' mean next-token loss of a
    micro-batch, its units the predicted tokens counted from the shape (rows x (S - 1): fake
    tensors hold no values to count)."""

    predicted: int

    def units(self, batch: dict) -> tuple[int]:
        return (self.predicted,)

    def loss_sums(self, out) -> tuple:
        return (out["loss"] * self.predicted,)

    def kept(self, out, batch: dict) -> None:
        return None


def fake_step(config: dict, family_config, checkpointed: bool, sharded: bool) -> StepMemory:
    """The run's own step (engines.torch_engine.take_step: forward, backward, the optimizer) of
    `family_config`'s causal LM at config's micro-batch, on fake tensors (nothing is allocated),
    its live bytes tracked (LiveBytes). Replicated (sharded
    False): the fp32 model, AdamW's state made before tracking (as after the first step), the
    step's micro-batches (two where the run accumulates: gradients held between them).
    Sharded: what FSDP2 computes with, the parameters in the compute dtype (bf16 gathers them
    in bf16, so autocast keeps no casts of them), one micro-batch, each gradient dropped once
    made (FSDP2 reduce-scatters it into the rank's share), no optimizer."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from packed_transformers.components.sharding import block_modules
    from packed_transformers.engines.torch_engine import StepSettings, take_step

    data = config["data"]
    length, rows = data["max_sequence_length"], data["micro_batch_rows"]
    bf16 = config["training"]["precision"] == "bf16"
    micro_batches = 1 if sharded else min(config["optim"]["gradient_accumulation"], 2)
    with FakeTensorMode():
        compute_dtype = torch.bfloat16 if sharded and bf16 else torch.float32
        model = AutoModelForCausalLM.from_config(
            family_config, attn_implementation="sdpa", dtype=compute_dtype
        )
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        held = [*model.parameters(), *model.buffers()]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # sharded: never steps (no gradient kept)
        if sharded:
            for parameter in model.parameters():
                parameter.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        else:
            for parameter in model.parameters():
                parameter.grad = torch.zeros_like(parameter)
            optimizer.step()  # AdamW's two moments exist from the first step on
            optimizer.zero_grad(set_to_none=True)
            held += [
                v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
            ]
        ids = torch.zeros(rows, length, dtype=torch.long)
        batches = [{"input_ids": ids, "labels": ids}] * micro_batches
        settings = StepSettings(torch.device("cpu"), "bf16" if bf16 else "fp32", check_finite=False)
        with LiveBytes(held, () if sharded else list(model.parameters())) as tracker:
            take_step(model, optimizer, batches, ShapeLoss(rows * (length - 1)), 1e-4, settings)
    blocks = block_modules(model)
    in_blocks = sum(p.numel() for block in blocks for p in block.parameters())
    parameters = sum(p.numel() for p in model.parameters())
    return StepMemory(
        parameters=parameters,
        root_parameters=parameters - in_blocks,
        block_parameters=max(sum(p.numel() for p in block.parameters()) for block in blocks),
        peak=tracker.peak,
        gradients=tracker.gradients_at_peak,
        activations=tracker.peak - tracker.baseline - tracker.gradients_at_peak,
    )


def rank_memory(step: StepMemory, gpus: int, sharded: bool, bf16: bool) -> RankMemory:
    """Bytes per rank of a run on `gpus` ranks (module docstring)."""
    if not sharded:  # the tracked peak: what every replica holds at it (buffers in the total)
        weights, optimizer = 4 * step.parameters, 8 * step.parameters
        return RankMemory(weights, step.gradients, optimizer, 0, step.activations, step.peak)
    share = -(-step.parameters // gpus)
    compute = 2 if bf16 else 4  # bytes of a gathered parameter (bf16 gathers in bf16 on CUDA)
    # the unsharded gradient itself is in the measured step; its fp32 copy for the reduce-scatter here
    gathered = (step.root_parameters + 2 * step.block_parameters) * compute + step.block_parameters * 4
    parts = (4 * share, 4 * share, 8 * share, gathered, step.activations)
    return RankMemory(*parts, total=sum(parts))


@dataclass(frozen=True)
class MemoryPlan:
    """A config's plan: its fake steps, replicated and as FSDP2 computes, without and with
    activation checkpointing (keyed (sharded, checkpointed))."""

    steps: dict[tuple[bool, bool], StepMemory]
    bf16: bool

    @property
    def parameters(self) -> int:
        return next(iter(self.steps.values())).parameters

    def per_rank(self, gpus: int, sharded: bool, checkpointed: bool) -> RankMemory:
        return rank_memory(self.steps[sharded, checkpointed], gpus, sharded, self.bf16)

    def needed(self, gpu_bytes: int, checkpointed: bool) -> tuple[int, bool] | None:
        """The fewest GPUs of `gpu_bytes` that hold the run, and whether it must shard (None:
        no count in GPU_COUNTS does)."""
        if self.per_rank(1, False, checkpointed).total <= USABLE_FRACTION * gpu_bytes:
            return 1, False
        for gpus in GPU_COUNTS[1:]:
            if self.per_rank(gpus, True, checkpointed).total <= USABLE_FRACTION * gpu_bytes:
                return gpus, True
        return None


def plan_memory(config: dict, vocab_size: int | None, checkpointing=(False, True)) -> MemoryPlan:
    """The config's plan (vocab_size: as planned_model_config takes it); checkpointing: the
    activation-checkpointing settings planned (each costs two fake steps)."""
    family_config = planned_model_config(config, vocab_size)
    bf16 = config["training"]["precision"] == "bf16"
    steps = {}
    for checkpointed in checkpointing:
        steps[False, checkpointed] = fake_step(config, family_config, checkpointed, sharded=False)
        # in fp32 FSDP2 computes as a replica does: the same activations
        steps[True, checkpointed] = (
            fake_step(config, family_config, checkpointed, sharded=True)
            if bf16
            else steps[False, checkpointed]
        )
    return MemoryPlan(steps, bf16)


def plan_report(plan: MemoryPlan, config: dict, source: str, gpus: int, gpu_gib: float) -> str:
    """The table `--plan` prints: per rank on `gpus` GPUs of `gpu_gib` GiB, without sharding and
    with FSDP2, then what the config needs."""
    gpu_bytes = int(gpu_gib * GIB)
    data, model = config["data"], config["model"]
    head = (f"Memory per rank, {source}: {model['family']}, {plan.parameters:,} parameters, "
            f"micro-batch {data['micro_batch_rows']} x {data['max_sequence_length']} tokens, "
            f"{config['training']['precision']}, gradient accumulation {config['optim']['gradient_accumulation']}")  # fmt: skip
    columns = [("no sharding", 1, False)] + ([(f"fsdp, {gpus} ranks", gpus, True)] if gpus > 1 else [])
    lines = [head, "", f"{'GiB':<40}" + "".join(f"{name:>20}" for name, _, _ in columns)]

    def row(label, values):
        lines.append(f"{label:<40}" + "".join(f"{v:>20}" for v in values))

    plain = [plan.per_rank(n, sharded, False) for _, n, sharded in columns]
    checked = [plan.per_rank(n, sharded, True) for _, n, sharded in columns]
    row("weights (fp32)", [f"{m.weights / GIB:.1f}" for m in plain])
    row("gradients (fp32)", [f"{m.gradients / GIB:.1f}" for m in plain])
    row("AdamW state (fp32, two moments)", [f"{m.optimizer / GIB:.1f}" for m in plain])
    row(
        "gathered by FSDP2", [f"{m.gathered / GIB:.1f}" if s else "-" for m, (_, _, s) in zip(plain, columns)]
    )
    row("activations", [f"{m.activations / GIB:.1f}" for m in plain])
    row("  with activation checkpointing", [f"{m.activations / GIB:.1f}" for m in checked])
    row("total", [f"{m.total / GIB:.1f}" for m in plain])
    row("  with activation checkpointing", [f"{m.total / GIB:.1f}" for m in checked])
    usable = USABLE_FRACTION * gpu_bytes
    row(f"fits {gpu_gib:g} GiB ({usable / GIB:.1f} usable)",
        [("yes" if a.total <= usable else "with checkpointing" if b.total <= usable else "no")
         for a, b in zip(plain, checked)])  # fmt: skip
    lines.append("")
    for checkpointed, how in (
        (False, "as configured"),
        (True, "with execution.activation_checkpointing: true"),
    ):
        needed = plan.needed(gpu_bytes, checkpointed)
        if needed is None:
            lines.append(f"needs ({how}): more than {GPU_COUNTS[-1]} GPUs of {gpu_gib:g} GiB")
        else:
            count, sharded = needed
            lines.append(f"needs ({how}): {count} GPU{'s' if count > 1 else ''} of {gpu_gib:g} GiB"
                         + (", execution.sharding: fsdp" if sharded else ""))  # fmt: skip
    return "\n".join(lines)


def rows_vocabulary(config: dict) -> int | None:
    """The vocabulary a plan builds the model with: model.vocab_size, else data.train_dir's
    metadata.json (None where neither is there: the rows need not exist to plan)."""
    import json
    from pathlib import Path

    if config["model"]["vocab_size"] is not None:
        return config["model"]["vocab_size"]
    metadata = Path(config["data"]["train_dir"]) / "metadata.json"
    try:
        value = json.loads(metadata.read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def print_plan(config: dict, source: str, gpus: int, gpu_gib: float) -> int:
    """run_pretraining.py --plan: the report on stdout; exit code 0 (RunError: 2, one line)."""
    from packed_transformers.common.cli import refuse

    try:
        plan = plan_memory(config, rows_vocabulary(config))
    except RunError as err:
        return refuse(err)
    print(plan_report(plan, config, source, gpus, gpu_gib))
    return 0
