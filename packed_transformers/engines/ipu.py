"""Graphcore IPU backend (PopTorch). The only module that imports poptorch, popdist and
horovod, and only when execution.device is ipu or ipu-model.

The run itself (data order, eval schedule, checkpoints, logging, stopping) is
training.run; this module supplies its engine (engines.engine.Engine):

    IpuPlan (engines.ipu_plan, pure)  ->  poptorch.Options
    PackedBertForPreTraining  ->  PretrainingStep with poptorch.BeginBlock per stage and
                                  recomputation checkpoints  ->  poptorch.trainingModel
    optim LAMB settings (beta^p)  ->  poptorch.optim.LAMB(**poptorch_lamb_kwargs(...))

Data: the host feeds PopTorch's combined batch (device iterations x replicas x gradient
accumulation x micro-batch) from components.data's resumable, instance-sharded loader
instead of poptorch.DataLoader, whose own sampler cannot resume at a micro-batch
position; under poprun each instance reads its own share and only instance 0 logs and
saves. Host-side sums (step counts, metrics) are all-reduced over instances with
Horovod, which the Poplar SDK ships for this purpose.

STATUS: written against the PopTorch 3.4 API; never executed on an IPU or the IPUModel
(no Poplar SDK here). The planning layer, PretrainingStep and the IPU kernels are tested on
CPU (tests/engines/test_ipu_plan.py); this engine runs through the real run loop against doubles
of PopTorch, popart, PopDist and Horovod that encode their documented rules
(tests/training/test_ipu_double.py: replicas, two poprun instances, resume, --compile-only,
synthetic data), also under the SDK stack's torch 2.0.1 (tests/training/test_ipu_sdk_stack.py,
opt-in); the IPUModel tests (tests/training/test_ipu_model.py) skip where poptorch is missing.
"""

from __future__ import annotations

import logging
import time

import torch

import packed_transformers.engines.ipu_plan as ipu_plan
from packed_transformers.components.data import padded_groups
from packed_transformers.components.distributed import use_host_sum
from packed_transformers.components.errors import RunError
from packed_transformers.components.observe import MetricSums, summarize
from packed_transformers.components.step import BatchArithmetic, StepLoss, set_learning_rate, step_counts
from packed_transformers.engines.engine import Snapshot, StepResult, staged_loss_only
from packed_transformers.engines.ipu_plan import IpuPlan, make_plan
from packed_transformers.engines.ipu_step import PretrainingStep, adapt_for_ipu, step_inputs
from packed_transformers.optim import poptorch_lamb_kwargs, weight_decay_groups

log = logging.getLogger("training.ipu")

SDK_VERSIONS = "Poplar SDK 3.4: Python 3.8/3.10, torch 2.0.1 (requirements-ipu.txt)"


def require_poptorch(device: str = "ipu"):
    """Import poptorch or raise RunError (exit code 2) before any data is read. Any failure
    counts: poptorch's own import asserts torch == 2.0.1 (python/__init__.py) and raises
    AssertionError under another torch, not ImportError."""
    import platform

    try:
        import poptorch
    except Exception as err:  # ImportError, or the version AssertionError, or a missing .so
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise RunError(
            f"execution.device {device} needs poptorch, which does not import here ({reason}); this "
            f"environment has Python {platform.python_version()} and torch {torch.__version__}, an SDK "
            f"environment needs {SDK_VERSIONS}: source <sdk>/enable.sh, pip install <sdk>/poptorch-*.whl "
            "-r requirements-ipu.txt; or choose execution.device cpu or cuda"
        ) from None
    return poptorch


def instance_topology() -> tuple[int, int]:
    """(instance index, instances) under poprun (PopDist), (0, 1) otherwise. Under poprun,
    popdist.init() and hvd.init() come first, as Graphcore's BERT does (Horovod refuses any
    collective before init: "Horovod has not been initialized; use hvd.init()")."""
    try:
        import popdist
    except ImportError:
        return 0, 1
    if not popdist.isPopdistEnvSet():
        return 0, 1
    popdist.init()
    import horovod.torch as hvd

    hvd.init()
    return popdist.getInstanceIndex(), popdist.getNumInstances()


def poprun_replicas() -> int | None:
    """Replicas poprun launched in total (None without poprun)."""
    try:
        import popdist
    except ImportError:
        return None
    return popdist.getNumTotalReplicas() if popdist.isPopdistEnvSet() else None


# PopART enum values as integers, not `import popart`: PopTorch's options.py has no mapping
# for PopART's enums and asks for their integer values, and `popart` imports only where
# PopART's enable.sh was sourced too (a Poplar-only environment would fail at attach, after
# the data was read). Values from popart/sessionoptions.hpp (SDK 3.4):
# AccumulateOuterFragmentSchedule {Scheduler = 0, Serial, OverlapCycleOptimized,
# OverlapMemoryOptimized}; SubgraphCopyingStrategy {OnEnterAndExit = 0, JustInTime, N}.
OVERLAP_MEMORY_OPTIMIZED = 3
JUST_IN_TIME = 1


def set_popart_performance_options(opts, pipelined: bool) -> None:
    """The PopART session options and patterns of Graphcore's BERT (nlp/bert/pytorch
    ipu_options.py, SDK 3.4), for the training executable: stream back only the tensors
    the host reads, overlap the weight update across IPUs (IPU 0, which also holds the
    embeddings and the heads, excluded), copy subgraph inputs just in time, schedule
    gradient consumers early, and the tied-gather patterns that let the MLM decoder and the
    word embeddings share one weight without a second copy of its gradient."""
    opts._Popart.set("disableGradAccumulationTensorStreams", True)
    if pipelined:
        opts._Popart.set("accumulateOuterFragmentSettings.schedule", OVERLAP_MEMORY_OPTIMIZED)
        opts._Popart.set("accumulateOuterFragmentSettings.excludedVirtualGraphs", ["0"])
    opts._Popart.set("subgraphCopyingStrategy", JUST_IN_TIME)
    opts._Popart.set("scheduleNonWeightUpdateGradientConsumersEarly", True)
    opts._Popart.setPatterns(
        {"TiedGather": True, "TiedGatherAccumulate": True, "UpdateInplacePrioritiesForIpu": True}
    )
    opts._Popart.set(
        "engineOptions", {"opt.useAutoloader": "true", "target.syncReplicasIndependently": "true"}
    )


def build_options(poptorch, plan: IpuPlan, training: bool, compile_only: bool = False):
    """IpuPlan -> poptorch.Options (popdist.poptorch.Options under poprun)."""
    if plan.instances > 1:
        import popdist.poptorch

        opts = popdist.poptorch.Options(ipus_per_replica=plan.ipus_per_replica)
    else:
        opts = poptorch.Options()
        opts.replicationFactor(plan.local_replicas)
    opts.autoRoundNumIPUs(True)
    # Options.randomSeed also calls torch.manual_seed (poptorch/options.py): building
    # options mid-run must not reseed the host, or resume stops being exact.
    with torch.random.fork_rng(devices=[]):
        opts.randomSeed(plan.seed)
    if plan.use_ipu_model:
        opts.useIpuModel(True)
    elif compile_only:
        # Compile for a Mk2 IPU without attaching to one (options.py useOfflineIpuTarget;
        # it "cannot be used if the IPU model is enabled", hence only for real IPUs).
        opts.useOfflineIpuTarget(2)
    # data.synthetic streams the host's random packs like real data. PopTorch's
    # enableSyntheticData is not used: it stops every host transfer, weights and outputs
    # included (python/options.py; PopART disables streaming and storing under it), so the
    # host would read uninitialised losses (a false exit 3 or garbage metrics) and write
    # checkpoints of stale weights (issue 33, N4). The cost: throughput includes host I/O.
    if plan.executable_cache_dir:
        opts.enableExecutableCaching(plan.executable_cache_dir)
    if plan.available_memory_proportion:
        opts.setAvailableMemoryProportion(plan.available_memory_proportion)
    # Stochastic rounding is for weight updates; inference keeps round-to-nearest.
    opts.Precision.enableStochasticRounding(plan.stochastic_rounding and training)
    if plan.half_partials:
        opts.Precision.setPartialsType(torch.float16)
    if plan.pipelined:
        opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    if training:
        opts.deviceIterations(plan.device_iterations)
        opts.Training.gradientAccumulation(plan.gradient_accumulation)
        # Mean over GA x replicas with the Running strategy, as Graphcore's BERT: fp16
        # accumulators hold a running mean (one micro-batch's gradient size), not the sum of
        # N, which left ~N times less overflow headroom (issue 33, N5). The host multiplies
        # the graph's loss scales by N (ipu_step.step_inputs), so the step's gradient is
        # unchanged.
        opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Mean)
        opts.Training.setMeanAccumulationAndReplicationReductionStrategy(
            poptorch.MeanReductionStrategy.Running
        )
        opts.outputMode(poptorch.OutputMode.Sum if plan.output_mode == "sum" else poptorch.OutputMode.All)
        opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings()
            .useOnChipStorage(not plan.optimizer_state_offchip)
            .useReplicatedTensorSharding(plan.replicated_tensor_sharding)
        )
        if plan.popart_performance_options:
            set_popart_performance_options(opts, plan.pipelined)
    else:
        # Compiler.cpp: a pipelined graph needs deviceIterations >= its pipeline stages.
        opts.deviceIterations(plan.inference_device_iterations)
        opts.outputMode(poptorch.OutputMode.All)
    return opts


def place_stages(poptorch, step: PretrainingStep, plan: IpuPlan) -> None:
    """poptorch.BeginBlock on each placement; recomputation checkpoints after layers."""
    for placement in plan.placements:
        parent_name, _, child = placement.module.rpartition(".")
        parent = step.get_submodule(parent_name) if parent_name else step
        module = getattr(parent, child) if not child.isdigit() else parent[int(child)]
        wrapped = poptorch.BeginBlock(module, user_id=placement.block, ipu_id=placement.ipu)
        if child.isdigit():
            parent[int(child)] = wrapped
        else:
            setattr(parent, child, wrapped)
    layers = step.model.encoder_layers
    for index in plan.recompute_layers:
        layers[index].register_forward_hook(
            lambda module, inputs, output: poptorch.recomputationCheckpoint(output)
        )


def _host_sum(tensor: torch.Tensor, instances: int) -> torch.Tensor:
    """Sum over poprun instances; Horovod was initialised by instance_topology."""
    if instances == 1:
        return tensor
    import horovod.torch as hvd

    return hvd.allreduce(tensor, op=hvd.Sum)


def _host_max(value: int, instances: int) -> int:
    """The largest of one integer per poprun instance. Horovod 0.24 (requirements-ipu.txt,
    as Graphcore pins it) has no Max reduction: horovod/torch/mpi_ops.py v0.24.0 exports
    Average, Sum and Adasum only (Min / Max came in 0.26.0, PR 3660). allgather is in
    both: every instance's value, then the max here."""
    if instances == 1:
        return int(value)
    import horovod.torch as hvd

    return int(hvd.allgather(torch.tensor([int(value)], dtype=torch.int64)).max())


def _gather_ints(values: list, instances: int) -> list:
    """One list of non-negative integers per poprun instance, in instance order. PopTorch's
    rng_state values are 64-bit unsigned (python/_poplar_executor.py); they travel as two
    32-bit halves in int64, as Horovod's allgather carries int64 exactly."""
    if instances == 1:
        return [list(values)]
    import horovod.torch as hvd

    halves = torch.tensor([[v >> 32, v & 0xFFFFFFFF] for v in values], dtype=torch.int64).reshape(1, -1)
    rows = hvd.allgather(halves).tolist()
    return [[(row[2 * i] << 32) | row[2 * i + 1] for i in range(len(values))] for row in rows]


def _relax_layer_norm_eps(model, eps: float) -> int:
    """fp16: LayerNorm eps 1e-12 underflows to 0 in half precision; Graphcore's BERT configs
    use layer_norm_eps 0.001. Returns how many LayerNorms were changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm) and module.eps < eps:
            module.eps = eps
            changed += 1
    return changed


FP16_LAYER_NORM_EPS = 1e-3


class IpuEngine:
    """The Engine on IPUs: one host process = one poprun instance, driving its local
    replicas; a `step` call runs `device_iterations` optimizer steps."""

    @staticmethod
    def check_config(config: dict) -> None:
        """The config's IPU refusals (ipu_plan.check_config), then poptorch's import: a
        config PopTorch could never compile is refused where poptorch is missing too."""
        ipu_plan.check_config(config)
        require_poptorch(config["execution"]["device"])

    def __init__(self, config: dict):
        self.config = config
        self.compile_only = config["execution"]["compile_only"]
        self.poptorch = require_poptorch(config["execution"]["device"])
        self.rank, self.instances = instance_topology()
        self.data_rank, self.data_world = self.rank, self.instances
        if self.instances > 1:
            # No torch.distributed under poprun: the run's own collectives (the output-folder
            # barrier, the stop flag every instance must agree on) go through Horovod too.
            use_host_sum(lambda values: _host_sum(values, self.instances))
        self.inference = None

    def attach(self, model, packing_factor: float) -> BatchArithmetic:
        # IpuPlanError is a RunError; the built model's vocabulary (a checkpoint may set it)
        # is checked against the decoder's serialization factor.
        self.plan = make_plan(self.config, packing_factor, self.instances, model.config.vocab_size)
        launched = poprun_replicas()
        if launched is not None and launched != self.plan.replicas:
            raise RunError(
                f"ipu.replicas is {self.plan.replicas} but poprun launched {launched} replicas: make them agree"
            )
        optim, adjusted = self.config["optim"], self.plan.adjusted
        self.steps_per_call = self.plan.device_iterations
        self.micro_batches_per_call = self.plan.micro_batches_per_call
        if self.rank == 0:
            log.info(self.plan.describe())

        poptorch = self.poptorch
        self.model = model.half() if self.plan.half else model
        if self.plan.half:
            changed = _relax_layer_norm_eps(self.model, FP16_LAYER_NORM_EPS)
            if self.rank == 0 and changed:
                log.info(
                    "fp16: LayerNorm eps raised to %g in %d modules (as Graphcore's BERT)",
                    FP16_LAYER_NORM_EPS,
                    changed,
                )
        adapt_for_ipu(
            self.model,
            self.plan.embedding_serialization_factor,
            self.plan.onehot_gather,
            lambda lhs, rhs, factor: poptorch.serializedMatMul(
                lhs, rhs, poptorch.MatMulSerializationMode.OutputChannels, factor
            ),
        )
        self.model.train()
        self.graph_step = PretrainingStep(
            self.model, lambda loss: poptorch.identity_loss(loss, reduction="none")
        )
        place_stages(poptorch, self.graph_step, self.plan)
        kwargs = poptorch_lamb_kwargs(
            weight_decay_groups(self.model.named_parameters(), optim["weight_decay"]),
            lr=0.0,
            adjusted=adjusted,
            eps=optim["eps"],
            weight_decay=optim["weight_decay"],
            bias_correction=optim["bias_correction"],
            loss_scaling=self.plan.loss_scaling,
            accum_type=self.plan.optimizer_accum_type,
            first_order_type=self.plan.optimizer_accum_type,
            second_order_type="float32",
        )
        self.optimizer = poptorch.optim.LAMB(**kwargs)
        self.training = poptorch.trainingModel(
            self.graph_step, build_options(poptorch, self.plan, True, self.compile_only), self.optimizer
        )
        # Built now, not at the first evaluation: building options touches the host RNG.
        self.inference_options = build_options(poptorch, self.plan, False, self.compile_only)
        self.pending_rng_state = None  # IPU RNG state from a checkpoint, set once compiled
        return self.plan.arithmetic

    def _training_inputs(self, micro_batches) -> tuple[dict, list[torch.Tensor]]:
        """One call's combined batch and each step's global [masked tokens, sequences]."""
        steps = self.plan.device_iterations
        per_step = len(micro_batches) // steps
        counts = []
        for i in range(steps):
            group = micro_batches[i * per_step : (i + 1) * per_step]
            counts.append(_host_sum(step_counts(group, "per_token", "cpu"), self.instances))
        return step_inputs(micro_batches, steps, counts, self.plan.mean_reduction_factor), counts

    def step(self, micro_batches, loss: StepLoss, lr: float) -> StepResult:
        """`device_iterations` optimizer steps in one call; the metric sums come back summed on
        the device (one SUM_KEYS vector for the call)."""
        staged_loss_only("IPU", loss)
        inputs, counts = self._training_inputs(micro_batches)
        set_learning_rate(self.optimizer, lr)
        self.training.setOptimizer(self.optimizer)  # pushes the new lr; state stays on device
        if not self.training.isCompiled():
            self._compile(inputs)
        _, device_sums = self.training(**inputs)
        kept = [device_sums.double().reshape(-1, device_sums.shape[-1]).sum(0)]
        return StepResult(torch.stack(counts).sum(0), None, kept)

    def _compile(self, inputs: dict) -> float:
        """Ahead of the first step: compile (timed, seconds returned), then restore a
        checkpoint's IPU RNG state, which PopTorch accepts only once there is an executable
        (rng_state setter). Not on an offline target: there is no device state to set."""
        started = time.perf_counter()
        self.training.compile(**inputs)
        seconds = time.perf_counter() - started
        if self.rank == 0:
            log.info("IPU training graph compiled in %.1f s", seconds)
        if self.pending_rng_state is not None and not self.compile_only:
            self.training.rng_state = self.pending_rng_state
            self.pending_rng_state = None
        return seconds

    def compile(self, micro_batches, eval_group: list[dict] | None) -> dict:
        """--compile-only: the training executable from one call's micro-batches and, when
        the run evaluates, the inference executable from one call's eval micro-batches.
        Nothing runs. Returns {"train": seconds, "eval": seconds}."""
        times = {"train": self._compile(self._training_inputs(micro_batches)[0])}
        # An IPUModel compile attaches; the inference executable needs the IPUs free (R6).
        if self.training.isAttachedToDevice():
            self.training.detachFromDevice()
        if eval_group is not None:
            self.inference = self.poptorch.inferenceModel(self.graph_step, self.inference_options)
            zero = [torch.zeros(2, dtype=torch.float64)] * self.plan.inference_device_iterations
            started = time.perf_counter()
            self.inference.compile(**step_inputs(eval_group, self.plan.inference_device_iterations, zero))
            times["eval"] = time.perf_counter() - started
            if self.rank == 0:
                log.info("IPU inference graph compiled in %.1f s", times["eval"])
            if self.inference.isAttachedToDevice():
                self.inference.detachFromDevice()
        return times

    def eval_group_size(self) -> int:
        """Micro-batches of one inference call on this instance."""
        return self.plan.local_replicas * self.plan.inference_device_iterations

    @torch.no_grad()
    def evaluate(self, shards, batches) -> dict:
        poptorch, plan = self.poptorch, self.plan
        if self.inference is None:
            self.inference = poptorch.inferenceModel(self.graph_step, self.inference_options)
        # One set of IPUs: the training executable lets go before the inference one attaches.
        # Only if attached: an evaluation right after another finds it detached already, and
        # PopTorch raises "Device is not attached" on a second detach.
        if self.training.isAttachedToDevice():
            self.training.detachFromDevice()  # also copies the weights and optimizer state to the host
        self.model.eval()
        sums = MetricSums()
        # Static shapes: each call takes inference_device_iterations micro-batches per local
        # replica. Every instance makes the same number of calls (the most any instance
        # needs, empty groups after its own), since each call is a collective across replicas.
        group_size = self.eval_group_size()
        calls = _host_max(-(-len(batches) // group_size), self.instances)
        for micro in padded_groups(shards, batches, group_size, plan.micro_batch_packs, groups=calls):
            zero = [torch.zeros(2, dtype=torch.float64)] * plan.inference_device_iterations
            _, device_sums = self.inference(**step_inputs(micro, plan.inference_device_iterations, zero))
            sums.add_vector(device_sums.double().reshape(-1, device_sums.shape[-1]).sum(0))
        if self.inference.isAttachedToDevice():
            self.inference.detachFromDevice()
        self.model.train()
        return summarize(self.reduce(sums))

    def reduce(self, sums: MetricSums) -> dict:
        return sums.reduce(lambda totals: _host_sum(totals, self.instances))

    def snapshot(self) -> Snapshot:
        # PopTorch's own way: a no-op when detaching already brought the weights back.
        self.training.copyWeightsToHostIfNeeded()
        state = {"optimizer": self.optimizer.state_dict()}  # PopTorch reads it back from the IPUs
        if self.training.isCompiled():
            # Every instance's IPU RNG state (a collective: snapshot runs on every instance),
            # so that each resumes its own stream: restoring instance 0's everywhere would
            # give every instance the same dropout masks after --resume.
            states = _gather_ints(list(self.training.rng_state), self.instances)
            state["ipu_rng_states"] = states
        return Snapshot(self.model, state)

    def load_state(self, engine_state: dict, path=None) -> None:
        if "optimizer" not in engine_state:  # a sharded run's: its optimizer is in dcp/
            raise RunError(f"--resume: {path} keeps its optimizer as a sharded run's dcp/ shards, which the IPU engine "
                           "does not read: resume it on the torch engine (execution.device cpu or cuda)")  # fmt: skip
        self.optimizer.load_state_dict(engine_state["optimizer"])
        self.training.setOptimizer(self.optimizer)
        states = engine_state.get("ipu_rng_states")
        if states is not None and len(states) != self.instances:
            raise RunError(
                f"the checkpoint holds IPU RNG states of {len(states)} poprun instances; this run has "
                f"{self.instances}: resume with the same number of instances"
            )
        # Checkpoints written before the per-instance states hold one, instance 0's.
        self.pending_rng_state = (
            states[self.rank] if states is not None else engine_state.get("ipu_rng_state")
        )
