"""Graphcore IPU backend (PopTorch). The only module that imports poptorch, popdist and
horovod, and only when execution.device is ipu or ipu-model.

The run itself (data order, eval schedule, checkpoints, logging, stopping) is
training.run; this module supplies its engine (training.backends.engine.Engine):

    IpuPlan (training.backends.ipu_plan, pure)  ->  poptorch.Options
    PackedBertForPreTraining  ->  PretrainingStep with poptorch.BeginBlock per stage and
                                  recomputation checkpoints  ->  poptorch.trainingModel
    optim LAMB settings (beta^p)  ->  poptorch.optim.LAMB(**poptorch_lamb_kwargs(...))

Data: the host feeds PopTorch's combined batch (device iterations x replicas x gradient
accumulation x micro-batch) from training.data's resumable, instance-sharded loader
instead of poptorch.DataLoader, whose own sampler cannot resume at a micro-batch
position; under poprun each instance reads its own share and only instance 0 logs and
saves. Host-side sums (step counts, metrics) are all-reduced over instances with
Horovod, which the Poplar SDK ships for this purpose.

STATUS: written against the PopTorch 3.x API; never executed here (no Poplar SDK). The
planning layer and PretrainingStep are tested on CPU (tests/test_ipu_plan.py); the
IPUModel tests in tests/ipu/ skip where poptorch is missing.
"""

from __future__ import annotations

import logging

import torch

from optim import poptorch_lamb_kwargs, weight_decay_groups
from training.backends.engine import Snapshot
from training.backends.ipu_plan import IpuPlan, make_plan
from training.backends.ipu_step import PretrainingStep, step_inputs
from training.data import padded_groups
from training.errors import RunError
from training.observe import MetricSums, summarize
from training.step import BatchArithmetic, set_learning_rate, step_counts

log = logging.getLogger("training.ipu")

POPTORCH_MISSING = (
    "execution.device {device} needs poptorch, which is not installed: install the poptorch wheel of "
    "Graphcore's Poplar SDK (source <sdk>/enable.sh; pip install <sdk>/poptorch-*.whl) or choose "
    "execution.device cpu or cuda"
)


def require_poptorch(device: str = "ipu"):
    """Import poptorch or raise RunError (exit code 2) before any data is read."""
    try:
        import poptorch
    except ImportError:
        raise RunError(POPTORCH_MISSING.format(device=device)) from None
    return poptorch


def instance_topology() -> tuple[int, int]:
    """(instance index, instances) under poprun (PopDist), (0, 1) otherwise."""
    try:
        import popdist
    except ImportError:
        return 0, 1
    if not popdist.isPopdistEnvSet():
        return 0, 1
    return popdist.getInstanceIndex(), popdist.getNumInstances()


def build_options(poptorch, plan: IpuPlan, training: bool):
    """IpuPlan -> poptorch.Options (popdist.poptorch.Options under poprun)."""
    if plan.instances > 1:
        import popdist.poptorch

        opts = popdist.poptorch.Options(ipus_per_replica=plan.ipus_per_replica)
    else:
        opts = poptorch.Options()
        opts.replicationFactor(plan.local_replicas)
    opts.autoRoundNumIPUs(True)
    opts.randomSeed(plan.seed)
    if plan.use_ipu_model:
        opts.useIpuModel(True)
    if plan.executable_cache_dir:
        opts.enableExecutableCaching(plan.executable_cache_dir)
    if plan.available_memory_proportion:
        opts.setAvailableMemoryProportion(plan.available_memory_proportion)
    opts.Precision.enableStochasticRounding(plan.stochastic_rounding)
    if plan.half_partials:
        opts.Precision.setPartialsType(torch.float16)
    if len(plan.layers_per_stage) > 1:
        opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    if training:
        opts.deviceIterations(plan.device_iterations)
        opts.Training.gradientAccumulation(plan.gradient_accumulation)
        # The graph's loss is already normalised by the step's global counts: sum, not mean.
        opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Sum)
        opts.outputMode(poptorch.OutputMode.Sum if plan.output_mode == "sum" else poptorch.OutputMode.All)
        opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings()
            .useOnChipStorage(not plan.optimizer_state_offchip)
            .useReplicatedTensorSharding(plan.replicated_tensor_sharding)
        )
    else:
        opts.deviceIterations(1)
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
    """Sum over poprun instances (Horovod ships with the Poplar SDK)."""
    if instances == 1:
        return tensor
    import horovod.torch as hvd

    return hvd.allreduce(tensor, op=hvd.Sum)


class IpuEngine:
    """The Engine on IPUs: one host process = one poprun instance, driving its local
    replicas; a `train` call runs `device_iterations` optimizer steps."""

    def __init__(self, config: dict):
        self.config = config
        self.poptorch = require_poptorch(config["execution"]["device"])
        self.rank, self.instances = instance_topology()
        self.data_rank, self.data_world = self.rank, self.instances
        self.inference = None

    def attach(self, model, packing_factor: float) -> BatchArithmetic:
        self.plan = make_plan(self.config, packing_factor, self.instances)  # IpuPlanError is a RunError
        optim, adjusted = self.config["optim"], self.plan.adjusted
        self.steps_per_call = self.plan.device_iterations
        self.micro_batches_per_call = self.plan.micro_batches_per_call
        if self.rank == 0:
            log.info(self.plan.describe())

        poptorch = self.poptorch
        self.model = model.half() if self.plan.half else model
        self.model.train()
        self.step = PretrainingStep(self.model, lambda loss: poptorch.identity_loss(loss, reduction="none"))
        place_stages(poptorch, self.step, self.plan)
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
            self.step, build_options(poptorch, self.plan, True), self.optimizer
        )
        return self.plan.batch

    def train(self, micro_batches, lr, sums: MetricSums) -> torch.Tensor:
        steps = self.plan.device_iterations
        per_step = len(micro_batches) // steps
        counts = []
        for i in range(steps):
            group = micro_batches[i * per_step : (i + 1) * per_step]
            counts.append(_host_sum(step_counts(group, "per_token", "cpu"), self.instances))
        set_learning_rate(self.optimizer, lr)
        self.training.setOptimizer(self.optimizer)  # pushes the new lr; state stays on device
        _, device_sums = self.training(**step_inputs(micro_batches, steps, counts))
        sums.add_vector(device_sums.double().reshape(-1, device_sums.shape[-1]).sum(0))
        return torch.stack(counts).sum(0)

    @torch.no_grad()
    def evaluate(self, shards, batches) -> dict:
        poptorch, plan = self.poptorch, self.plan
        if self.inference is None:
            self.inference = poptorch.inferenceModel(self.step, build_options(poptorch, plan, False))
        self.training.detachFromDevice()
        self.model.eval()
        sums = MetricSums()
        # One micro-batch per local replica per call; static shapes.
        for micro in padded_groups(shards, batches, plan.local_replicas, plan.micro_batch_packs):
            zero = [torch.zeros(2, dtype=torch.float64)]
            _, device_sums = self.inference(**step_inputs(micro, 1, zero))
            sums.add_vector(device_sums.double().reshape(-1, device_sums.shape[-1]).sum(0))
        self.inference.detachFromDevice()
        self.model.train()
        return summarize(self.reduce(sums))

    def reduce(self, sums: MetricSums) -> dict:
        return sums.reduce(lambda totals: _host_sum(totals, self.instances))

    def snapshot(self) -> Snapshot:
        self.training.copyWeightsToHost()
        # PopTorch reads the optimizer state back from the IPUs.
        return Snapshot(self.model, {"optimizer": self.optimizer.state_dict()})

    def load_state(self, engine_state: dict) -> None:
        self.optimizer.load_state_dict(engine_state["optimizer"])
        self.training.setOptimizer(self.optimizer)
