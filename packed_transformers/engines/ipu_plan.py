"""IPU planning: a validated config -> `IpuPlan`, every PopTorch option value in one dataclass.

Pure Python (no poptorch import), so the plan, its batch arithmetic and its errors are
tested on any machine; `engines.ipu` applies a plan with the real PopTorch API.

Placement follows Graphcore's pipelined BERT: the embeddings and the first encoder layers
on IPU 0, the other layers as `execution.layers_per_stage` lists them (one stage per IPU),
and the pretraining heads back on IPU 0, where the MLM decoder shares its weight with the
word embeddings (a tied weight must live on one IPU). IPU 0 may hold no encoder layer
([0, 4, 4, 4], Graphcore's BERT-Base layout): then it holds the embeddings and the heads.

Batch arithmetic: components.step.BatchArithmetic (the torch engines' own), plus
    packs per host call = packs per step x device_iterations
"""

from __future__ import annotations

from dataclasses import dataclass, field

from packed_transformers.components.errors import RunError
from packed_transformers.components.step import BatchArithmetic
from packed_transformers.model.config import bert_config, stage_layer_ranges
from packed_transformers.optim import AdjustedHyperparameters


class IpuPlanError(RunError):
    """A config that cannot run on IPUs; the message names the key to change."""


@dataclass(frozen=True)
class Placement:
    """A module (dotted name in PackedBertForPreTraining) that starts a pipeline block."""

    module: str  # dotted path in engines.ipu_step.PretrainingStep
    ipu: int
    block: str  # PopTorch user_id of the block (names the stage in reports)


@dataclass(frozen=True)
class IpuPlan:
    # topology
    replicas: int  # all instances together
    instances: int  # poprun instances (host processes); 1 without poprun
    ipus_per_replica: int
    use_ipu_model: bool
    # batch
    arithmetic: BatchArithmetic  # packs, GA and betas after the packing adjustment
    device_iterations: int
    # pipeline
    layers_per_stage: tuple[int, ...]
    placements: tuple[Placement, ...]
    recompute_layers: tuple[int, ...]  # encoder layers followed by a recomputation checkpoint
    forward_stages: int  # PopTorch's count: 1 + IPU changes along the placements
    # numerics
    half: bool
    loss_scaling: float
    stochastic_rounding: bool
    half_partials: bool
    optimizer_accum_type: str
    # memory and execution
    replicated_tensor_sharding: bool
    optimizer_state_offchip: bool
    embedding_serialization_factor: int  # MLM decoder matmul split over the vocabulary
    onehot_gather: bool  # gathers as one-hot matmuls (engines.ipu_step.OneHotGather)
    popart_performance_options: bool  # Graphcore BERT's PopART session options and patterns
    synthetic_data: bool  # random packs made on the host (streamed like real data)
    available_memory_proportion: dict[str, float] = field(default_factory=dict)
    output_mode: str = "sum"
    seed: int = 42
    executable_cache_dir: str | None = None

    @property
    def micro_batch_packs(self) -> int:
        return self.arithmetic.micro_batch_packs

    @property
    def adjusted(self) -> AdjustedHyperparameters:
        return self.arithmetic.adjusted

    @property
    def packing_factor(self) -> float:
        return self.arithmetic.packing_factor

    @property
    def gradient_accumulation(self) -> int:
        return self.arithmetic.gradient_accumulation

    @property
    def betas(self) -> tuple[float, float]:
        return self.arithmetic.betas

    @property
    def local_replicas(self) -> int:
        """Replicas driven by this host process."""
        return self.replicas // self.instances

    @property
    def packs_per_step(self) -> int:
        return self.arithmetic.packs_per_step

    @property
    def packs_per_call(self) -> int:
        return self.packs_per_step * self.device_iterations

    @property
    def micro_batches_per_call(self) -> int:
        """Micro-batches one instance feeds per host call (its share of packs_per_call)."""
        return self.gradient_accumulation * self.local_replicas * self.device_iterations

    @property
    def sequences_per_step(self) -> float:
        return self.arithmetic.sequences_per_step

    @property
    def pipelined(self) -> bool:
        return len(self.layers_per_stage) > 1

    @property
    def inference_device_iterations(self) -> int:
        """A pipelined inference graph needs deviceIterations >= its pipeline stages
        (popart_compiler Compiler.cpp: "deviceIterations must be greater than or equal to
        the number of pipeline stages"); one call then evaluates this many micro-batches
        per replica."""
        return self.forward_stages if self.pipelined else 1

    @property
    def mean_reduction_factor(self) -> int:
        """N = GA x replicas (all instances): what PopTorch's Mean reduction divides the
        accumulated gradient by, and what the host multiplies the graph's loss scales by.
        Each micro-batch's graph loss is then about a micro-batch mean loss, as in
        Graphcore's configs, so `ipu.loss_scaling` means what it means there."""
        return self.gradient_accumulation * self.replicas

    @property
    def total_ipus(self) -> int:
        return self.replicas * self.ipus_per_replica

    def describe(self) -> str:
        stages = " | ".join(
            f"IPU{i}: {'+'.join(p.block for p in self.placements if p.ipu == i)}"
            for i in range(self.ipus_per_replica)
        )
        return (
            f"IPU plan: {self.replicas} replicas x {self.ipus_per_replica} IPUs = {self.total_ipus} IPUs "
            f"({self.instances} instance(s)); step = {self.micro_batch_packs} packs x GA "
            f"{self.gradient_accumulation} x {self.replicas} replicas = {self.packs_per_step} packs "
            f"(~{self.sequences_per_step:.0f} sequences); {self.device_iterations} step(s) per host call; "
            f"stages: {stages}; {'fp16' if self.half else 'fp32'}, loss scale {self.loss_scaling:g}"
            + (" [IPUModel simulator]" if self.use_ipu_model else "")
        )


def forward_stages(placements) -> int:
    """Forward pipeline stages of placements in execution order: PopTorch's AutoIncrement
    starts a new stage wherever the IPU changes (poptorch popart_compiler
    CompilerImpl.cpp), so emb+L0 on IPU0 -> L1 on IPU1 -> heads back on IPU0 is 3."""
    ipus = [p.ipu for p in placements]
    return 1 + sum(a != b for a, b in zip(ipus, ipus[1:]))


def training_pipeline_stages(forward: int) -> int:
    """Pipeline stages of a training graph: every forward stage has a backward stage, the
    last forward and first backward share one (PopART: 2F - 1). Gradient accumulation
    must be at least this, or PopART refuses to compile the pipeline."""
    return 2 * forward - 1


def check_config(config: dict) -> None:
    """Every refusal of an IPU run that the config alone decides (IpuPlanError naming the
    key); the engine calls it before any data is opened or hashed."""
    execution, model_cfg = config["execution"], config["model"]
    if execution["device"] not in ("ipu", "ipu-model"):
        raise IpuPlanError(f"execution.device is {execution['device']!r}: an IPU plan needs ipu or ipu-model")
    if model_cfg["attention_backend"] != "dense":
        raise IpuPlanError(
            f"model.attention_backend {model_cfg['attention_backend']!r}: PopTorch compiles the dense "
            "additive-mask attention only (sdpa, flex and varlen are CPU/CUDA kernels); set it to dense"
        )
    if model_cfg["mlm_loss_mode"] != "per_token":
        raise IpuPlanError(
            "model.mlm_loss_mode per_sequence reads a tensor value on the host (K of the batch), "
            "which a static PopTorch graph cannot; use per_token"
        )
    if model_cfg["recompute_layers"]:
        raise IpuPlanError(
            "model.recompute_layers is torch activation checkpointing; on IPUs use ipu.recompute_checkpoints"
        )
    if config["training"]["precision"] != "fp32":
        raise IpuPlanError(
            f"training.precision {config['training']['precision']!r} is a torch autocast setting; on IPUs "
            "set training.precision fp32 and choose fp16 with ipu.half"
        )
    if config["training"]["on_nonfinite"] == "skip":
        raise IpuPlanError(
            "training.on_nonfinite skip: on IPUs the optimizer steps on the device and the host sees the "
            "loss once per logging window, so a step cannot be skipped; use stop"
        )
    if config["optim"]["max_grad_norm"] is not None:
        raise IpuPlanError(
            "optim.max_grad_norm: poptorch.optim.LAMB has no global gradient-norm clipping; set it to null "
            "(Graphcore's MLPerf BERT trains without it)"
        )
    stage_ranges(config)
    if model_cfg["init_checkpoint"] is None:  # else the checkpoint decides the vocabulary (make_plan)
        check_serialization(config["ipu"]["embedding_serialization_factor"], model_cfg["vocab_size"])
    memory_proportions(config["ipu"])


def stage_ranges(config: dict) -> list[range]:
    """The encoder layers of each IPU, from execution.layers_per_stage (checked)."""
    ipu, model_cfg = config["ipu"], config["model"]
    layers = bert_config(model_cfg["preset"]).num_hidden_layers
    split = config["execution"]["layers_per_stage"]
    if split is None:
        raise IpuPlanError(
            f"execution.layers_per_stage must list the encoder layers of each IPU (the model has {layers} "
            f"layers), e.g. {even_split(layers, ipu['ipus_per_replica'])}"
        )
    if len(split) > ipu["ipus_per_replica"]:
        raise IpuPlanError(
            f"execution.layers_per_stage has {len(split)} stages but ipu.ipus_per_replica is "
            f"{ipu['ipus_per_replica']}: one stage per IPU"
        )
    try:
        ranges = stage_layer_ranges(layers, split)
    except ValueError as err:
        raise IpuPlanError(f"execution.layers_per_stage: {err}") from None
    # IPU 0 always runs the embeddings and the heads, so it may go without encoder layers;
    # any other empty stage would be an IPU with nothing to do.
    if any(len(r) == 0 for r in ranges[1:]) or (len(ranges) == 1 and not ranges[0]):
        raise IpuPlanError(
            f"execution.layers_per_stage {list(split)}: a stage without layers after IPU 0; only IPU 0 "
            "(embeddings and heads) may hold none"
        )
    return ranges


def check_serialization(factor: int, vocab_size: int) -> None:
    """The MLM decoder is split over the vocabulary into `factor` equal parts."""
    if vocab_size % factor:
        raise IpuPlanError(
            f"ipu.embedding_serialization_factor {factor} does not divide the vocabulary ({vocab_size} "
            "tokens): poptorch.serializedMatMul needs a factor of the dimension it splits"
        )


def memory_proportions(ipu: dict) -> dict[str, float]:
    """{"IPU<i>": proportion} from ipu.available_memory_proportion (one value or one per IPU)."""
    proportions = ipu["available_memory_proportion"]
    if proportions is not None:
        if len(proportions) not in (1, ipu["ipus_per_replica"]):
            raise IpuPlanError(
                f"ipu.available_memory_proportion has {len(proportions)} values: give one, or one per IPU "
                f"({ipu['ipus_per_replica']})"
            )
        if any(not 0 < p <= 1 for p in proportions):
            raise IpuPlanError(f"ipu.available_memory_proportion {proportions}: values must be in (0, 1]")
        if len(proportions) == 1:
            proportions = proportions * ipu["ipus_per_replica"]
    return {f"IPU{i}": float(p) for i, p in enumerate(proportions or [])}


def placements_of(ranges: list[range]) -> list[Placement]:
    """As Graphcore's pipelined BERT: a block per encoder layer on its IPU (PopTorch's
    AutoIncrement starts a new pipeline stage only where the IPU changes); the embeddings
    and the heads on IPU 0, next to the tied word embeddings."""
    placements = [Placement("model.bert.embeddings", 0, "embeddings")]
    for stage, layer_range in enumerate(ranges):
        for layer in layer_range:  # an empty IPU 0 adds no placement
            placements.append(Placement(f"model.bert.encoder.layer.{layer}", stage, f"encoder{layer}"))
    placements.append(Placement("heads", 0, "heads"))
    return placements


def make_plan(
    config: dict, packing_factor: float, instances: int = 1, vocab_size: int | None = None
) -> IpuPlan:
    """Config (validated by training.config) -> IpuPlan, or IpuPlanError naming the key.
    Repeats `check_config`, then what needs the data (its packing factor sets gradient
    accumulation, which the pipeline depth bounds), the launch (poprun instances) or the
    built model (`vocab_size`: a checkpoint may decide it; None = the config's)."""
    check_config(config)
    ipu, execution = config["ipu"], config["execution"]
    if instances < 1 or ipu["replicas"] % instances:
        raise IpuPlanError(
            f"ipu.replicas {ipu['replicas']} is not a multiple of the {instances} poprun instance(s)"
        )
    ranges = stage_ranges(config)
    factor = ipu["embedding_serialization_factor"]
    if vocab_size is not None:
        check_serialization(factor, vocab_size)
    arithmetic = BatchArithmetic.from_config(config, packing_factor, ipu["replicas"])
    placements = placements_of(ranges)
    forward = forward_stages(placements)
    needed = training_pipeline_stages(forward)
    split = execution["layers_per_stage"]
    if len(split) > 1 and arithmetic.adjusted.gradient_accumulation < needed:
        raise IpuPlanError(
            f"gradient accumulation {arithmetic.adjusted.gradient_accumulation} (optim.gradient_accumulation "
            f"after the packing adjustment) is smaller than the {needed} training pipeline stages (PopTorch "
            f"counts {forward} forward stages: a new one at every IPU change, the heads back on IPU 0 "
            f"included; training needs 2 x {forward} - 1): raise optim.gradient_accumulation"
        )
    layers = sum(len(r) for r in ranges)
    # Checkpoint every layer output but the last: in a pipeline, activations between
    # checkpoints are recomputed in the backward pass instead of stashed.
    recompute = tuple(range(layers - 1)) if ipu["recompute_checkpoints"] else ()
    return IpuPlan(
        replicas=ipu["replicas"],
        instances=instances,
        ipus_per_replica=ipu["ipus_per_replica"],
        use_ipu_model=execution["device"] == "ipu-model",
        arithmetic=arithmetic,
        device_iterations=ipu["device_iterations"],
        layers_per_stage=tuple(split),
        placements=tuple(placements),
        recompute_layers=recompute,
        half=ipu["half"],
        loss_scaling=ipu["loss_scaling"],
        stochastic_rounding=ipu["stochastic_rounding"],
        half_partials=ipu["half_partials"],
        optimizer_accum_type=ipu["optimizer_accum_type"],
        forward_stages=forward,
        replicated_tensor_sharding=ipu["replicated_tensor_sharding"] and ipu["replicas"] > 1,
        optimizer_state_offchip=ipu["optimizer_state_offchip"],
        embedding_serialization_factor=factor,
        onehot_gather=ipu["onehot_gather"],
        popart_performance_options=ipu["popart_performance_options"],
        synthetic_data=config["data"]["synthetic"],
        available_memory_proportion=memory_proportions(ipu),
        output_mode=ipu["output_mode"],
        seed=config["training"]["seed"],
        executable_cache_dir=ipu["executable_cache_dir"],
    )


def even_split(layers: int, stages: int) -> list[int]:
    """A suggestion for the error message: layers spread as evenly as possible."""
    base, extra = divmod(layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]
