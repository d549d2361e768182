"""A test double of PopTorch 3.4 for tests/training/test_ipu_double.py: tests only, never product code.

It runs the compiled step eagerly on CPU and enforces the PopTorch rules our IPU engine must
obey, each with its source in graphcore/poptorch (3.4) or PopART:

R1 combined batch: every input's first dimension is a multiple of deviceIterations x
   replicationFactor x gradientAccumulation (python/_poplar_executor.py, _narrow_tensor:
   "Invalid batch dimension ... must be a multiple of").
R2 static graph: later calls pass the same inputs with the same shapes and dtypes as the call
   that compiled (python/_poplar_executor.py: "Number of arguments mismatch"; a traced graph
   has fixed shapes).
R3 forward pipeline stages = 1 + IPU changes in execution order under
   AutoStage.AutoIncrement (popart_compiler/source/CompilerImpl.cpp); a training pipeline has
   2F - 1 stages and gradientAccumulation must be >= that (PopART Ir pipelining checks).
R4 a pipelined inference graph needs deviceIterations >= its pipeline stages
   (popart_compiler/source/Compiler.cpp: "deviceIterations must be greater than or equal to the
   number of pipeline stages").
R5 attach/detach: calling attaches if detached; detachFromDevice needs a compiled, attached
   executable ("Device is not attached"); detaching a training model copies weights and
   optimizer state to the host (python/_poplar_executor.py detachFromDevice).
R6 one set of IPUs: a second executable cannot attach while another holds the same IPUs
   (the training model must be detached before an inference model on the same IPUs runs).
R7 rng_state can be read or set only once compiled (python/_poplar_executor.py, rng_state).
   It is the state of this process's replicas (popart_compiler Compiler.cpp reads the local
   replicas' seeds), so poprun instances hold different states: the double's is
   [seed, calls, instance index].
R8 Options.randomSeed also seeds the host: torch.manual_seed (python/options.py).
R9 poptorch.optim.LAMB takes exactly these keywords (python/optim.py): params, lr, betas, eps,
   weight_decay, bias_correction, loss_scaling, max_weight_norm, accum_type,
   first_order_momentum_accum_type, second_order_momentum_accum_type.
R10 ReductionType.Sum: gradients of the micro-batches and replicas are summed; Mean (the
   default, python/options.py _TrainingOptions) divides that sum by GA x replicas (all
   instances: PopART's Optimizer::setFactorsFromOptions uses the global replication
   factor); the Running strategy keeps a running mean in the accumulator, the same value
   in exact arithmetic (popart sessionoptions.hpp MeanReductionStrategy).
   OutputMode.Sum returns outputs summed over the call, OutputMode.All every micro-batch's.
R11 useOfflineIpuTarget (python/options.py): connection type Never; "the offline IPU target
   cannot be used if the IPU model is enabled"; such an executable compiles but never
   attaches, so it cannot run.
R12 serializedMatMul (python/ops.py): asserts an int factor and a MatMulSerializationMode;
   the factor must divide the dimension it splits (its docstring); result = lhs @ rhs.
R13 Options._Popart.set takes PopART SessionOptions names (popart/sessionoptions.hpp);
   PopART refuses an unknown name when the session is built (here: at compile).
   setPatterns takes PopART pattern names (popart/patterns).
R15 replicas of a popdist.poptorch.Options run (poprun instances) reduce gradients across ALL
   replicas, not only this instance's (PopDist's replicated graph spans the instances); the
   double carries that sum over the Horovod double's transport (on hardware: GCL over
   IPU-Links, no host involved).
R14 enableSyntheticData(bool) sets the PopART option syntheticDataMode 2 (RandomNormal) or 0
   (python/options.py). Its docstring: no data is streamed between host and IPUs at all, so
   the host's output buffers are never written (the double returns NaN in them) and the
   host's weights are never updated (the double trains a device-side copy of the model).
R16 compiling a graph that calls an ATen op PopTorch has no handler for stops with
   "Unsupported ops found in compiled model: [aten::...]" (poptorch/source/
   ErrorOnUnsupportedAten.cpp), on the IPUModel too. The double records the forward's ATen
   ops at compile and refuses those in UNSUPPORTED_ATEN, each with its source; it cannot
   list every op PopTorch lacks, only the ones named there.

What it cannot show: compilation, memory, fp16 numerics, real replicas in parallel, Poplar
errors this file does not encode, what PopART's options and patterns do (only that their
names exist), synthetic data (the double computes on the host's inputs). Numerics are CPU
float32.
"""

from __future__ import annotations

import enum
import os

import torch

from packed_transformers.optim.lamb import Lamb

_ATTACHED: list = []  # executables holding the (one) set of IPUs

# R16: ATen ops with no PopTorch 3.4 handler, each with its source.
UNSUPPORTED_ATEN = {
    # docs/user_guide/supported_ops.rst (sdk/poptorch/3.4.0), "Creation ops": arange, fill,
    # full, full_like, new_ones, new_zeros, ones, ones_like, zeros, zeros_like; no eye
    # (tests/tensor_ops_test.py lists torch.eye among the unsupported creation ops).
    "aten::eye",
}


def _aten_ops(model, batch) -> set:
    """The ATen ops one forward of `model` on `batch` calls (R16)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func._schema.name)  # "aten::eye"
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), torch.random.fork_rng(devices=[]), Record():
        model(**batch)
    return seen


class ReductionType(enum.Enum):
    Sum = 0
    Mean = 1


class MeanReductionStrategy(enum.Enum):  # python/enums.py
    Running = 0
    Post = 1
    PostAndLoss = 2


class OutputMode(enum.Enum):
    All = 0
    Sum = 1
    Final = 2


class AutoStage(enum.Enum):
    SameAsIpu = 0
    AutoIncrement = 1


class PipelinedExecution:
    def __init__(self, auto_stage=AutoStage.SameAsIpu):
        self.auto_stage = auto_stage


class MatMulSerializationMode(enum.Enum):
    InputChannels = "input_channels"
    ReducingDim = "reducing_dim"
    OutputChannels = "output_channels"
    Disabled = "none"


class ConnectionType(enum.Enum):
    Always = 0
    OnDemand = 1
    Never = 2


def serializedMatMul(lhs, rhs, mode, factor=0, keep_precision=False):
    assert isinstance(keep_precision, bool)  # R12, as python/ops.py
    assert isinstance(factor, int)
    assert isinstance(mode, MatMulSerializationMode)
    split = {
        MatMulSerializationMode.InputChannels: lhs.shape[-2],
        MatMulSerializationMode.ReducingDim: lhs.shape[-1],
        MatMulSerializationMode.OutputChannels: rhs.shape[-1],
    }.get(mode)
    if split is not None and factor and split % factor:
        raise RuntimeError(f"serialization factor {factor} does not divide the split dimension {split}")
    return torch.matmul(lhs, rhs)


# R13: the PopART session options and patterns the project sets (all exist in PopART 3.4).
POPART_SESSION_OPTIONS = {
    "disableGradAccumulationTensorStreams",
    "accumulateOuterFragmentSettings.schedule",
    "accumulateOuterFragmentSettings.excludedVirtualGraphs",
    "subgraphCopyingStrategy",
    "scheduleNonWeightUpdateGradientConsumersEarly",
    "engineOptions",
    "syntheticDataMode",
}
POPART_PATTERNS = {"TiedGather", "TiedGatherAccumulate", "UpdateInplacePrioritiesForIpu"}


class _Popart:
    def __init__(self):
        self.options, self.patterns = {}, {}

    def set(self, key, value):
        self.options[key] = value

    def setPatterns(self, patterns: dict, level=None):
        self.patterns.update(patterns)


class TensorLocationSettings:
    def useOnChipStorage(self, on: bool = True):
        self.on_chip = on
        return self

    def useReplicatedTensorSharding(self, on: bool = True):
        self.rts = on
        return self


class _Training:
    def __init__(self):
        self.gradient_accumulation = 1
        self.reduction = ReductionType.Mean

    def gradientAccumulation(self, n: int):
        self.gradient_accumulation = n

    def accumulationAndReplicationReductionType(self, t):
        self.reduction = t

    def setMeanAccumulationAndReplicationReductionStrategy(self, strategy):
        if not isinstance(strategy, MeanReductionStrategy):
            raise TypeError("expected a poptorch.MeanReductionStrategy")
        self.mean_strategy = strategy


class _Precision:
    def enableStochasticRounding(self, on: bool):
        self.stochastic_rounding = on

    def setPartialsType(self, dtype):
        self.partials = dtype


class _TensorLocations:
    def setOptimizerLocation(self, settings):
        self.optimizer = settings


class Options:
    def __init__(self):
        self.device_iterations = 1
        self.replication_factor = 1
        self.output_mode = OutputMode.Final
        self.pipelined = False
        self.Training = _Training()
        self.Precision = _Precision()
        self.TensorLocations = _TensorLocations()
        self._Popart = _Popart()
        self.connection_type = ConnectionType.Always
        self.ipu_model = False

    def useOfflineIpuTarget(self, ipu_version: int = 2):
        self.connection_type = ConnectionType.Never  # R11
        self.ipu_version = ipu_version

    def enableSyntheticData(self, enabled: bool):
        self._Popart.set("syntheticDataMode", 2 if enabled else 0)  # R14

    def deviceIterations(self, n: int):
        self.device_iterations = n

    def replicationFactor(self, n: int):
        self.replication_factor = n

    def autoRoundNumIPUs(self, on: bool):
        pass

    def randomSeed(self, seed: int):
        torch.manual_seed(seed)  # R8
        self.seed = seed

    def useIpuModel(self, on: bool):
        self.ipu_model = on

    def enableExecutableCaching(self, path: str):
        self.cache = path

    def setAvailableMemoryProportion(self, proportions: dict):
        self.memory = proportions

    def setExecutionStrategy(self, strategy):
        self.pipelined = isinstance(strategy, PipelinedExecution)

    def outputMode(self, mode):
        self.output_mode = mode


def BeginBlock(module, user_id=None, ipu_id=0):
    module._double_ipu_id = ipu_id
    return module


def recomputationCheckpoint(x):
    return x


def identity_loss(x, reduction):
    assert reduction in ("sum", "mean", "none")
    return x


class _Optim:
    class LAMB(Lamb):
        def __init__(
            self,
            params,
            lr=None,
            betas=None,
            eps=None,
            weight_decay=None,
            bias_correction=None,
            loss_scaling=None,
            max_weight_norm=None,
            accum_type=None,
            first_order_momentum_accum_type=None,
            second_order_momentum_accum_type=None,
        ):  # R9: any other keyword is a TypeError, as in PopTorch
            super().__init__(
                params,
                lr=lr,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
                bias_correction=bias_correction,
                max_weight_norm=max_weight_norm,
            )
            self.loss_scaling = loss_scaling or 1.0


optim = _Optim()


class PoplarExecutor:
    def __init__(self, model, options: Options, training: bool, optimizer=None):
        self.model, self.options, self.training, self.optimizer = model, options, training, optimizer
        self._signature = None
        self._attached = False
        self._rng = None
        self.calls = 0

    # R3: stages from the BeginBlock IPUs in execution order
    def _forward_stages(self, inputs) -> int:
        order = []
        hooks = [
            m.register_forward_pre_hook(lambda mod, args: order.append(mod._double_ipu_id))
            for m in self.model.modules()
            if hasattr(m, "_double_ipu_id")
        ]
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                self.model(**self._micro_batches(inputs)[0])
        finally:
            for h in hooks:
                h.remove()
        return 1 + sum(a != b for a, b in zip(order, order[1:]))

    def _factor(self) -> int:
        ga = self.options.Training.gradient_accumulation if self.training else 1
        return self.options.device_iterations * self.options.replication_factor * ga

    def _micro_batches(self, inputs) -> list[dict]:
        n = self._factor()
        rows = next(iter(inputs.values())).shape[0] // n
        return [{k: v[i * rows : (i + 1) * rows] for k, v in inputs.items()} for i in range(n)]

    def compile(self, **inputs):
        unknown = set(self.options._Popart.options) - POPART_SESSION_OPTIONS
        unknown |= set(self.options._Popart.patterns) - POPART_PATTERNS
        if unknown:  # R13
            raise RuntimeError(f"Unknown PopART option or pattern: {sorted(unknown)}")
        offline = self.options.connection_type == ConnectionType.Never
        if offline and self.options.ipu_model:  # R11
            raise RuntimeError("the offline IPU target cannot be used if the IPU model is enabled")
        for name, value in inputs.items():  # R1
            if value.shape[0] % self._factor():
                raise RuntimeError(
                    f"Invalid batch dimension: In the input {name}, the batch dimension "
                    f"({value.shape[0]}) must be a multiple of {self._factor()}"
                )
        unsupported = sorted(_aten_ops(self.model, self._micro_batches(inputs)[0]) & UNSUPPORTED_ATEN)
        if unsupported:  # R16
            raise RuntimeError(
                f"Unsupported ops found in compiled model: [{', '.join(unsupported)}]. Not all operations "
                "are supported yet by Graphcore's PyTorch compiler."
            )
        self._signature = {k: (tuple(v.shape), v.dtype) for k, v in inputs.items()}
        stages = self._forward_stages(inputs) if self.options.pipelined else 1
        if (
            self.training
            and self.options.pipelined
            and self.options.Training.gradient_accumulation < 2 * stages - 1
        ):
            raise RuntimeError(
                f"gradient accumulation {self.options.Training.gradient_accumulation} < "
                f"{2 * stages - 1} pipeline stages"
            )  # R3
        if not self.training and self.options.pipelined and self.options.device_iterations < stages:
            raise RuntimeError(
                "deviceIterations must be greater than or equal to the number of pipeline stages"
            )  # R4
        self.forward_stages = stages
        instance = int(os.environ.get("DOUBLE_POPDIST_INSTANCE", "0"))  # R7: per instance
        self._rng = [self.options.__dict__.get("seed", 0), 0, instance]
        if not offline:  # R11: an offline executable never attaches
            self.attachToDevice()

    def isCompiled(self) -> bool:
        return self._signature is not None

    def isAttachedToDevice(self) -> bool:
        return self.isCompiled() and self._attached

    def attachToDevice(self):
        if self.options.connection_type == ConnectionType.Never:  # R11
            raise RuntimeError("Cannot attach: the executable was compiled for an offline IPU target")
        if self._attached:
            raise RuntimeError("Device is already attached")
        if _ATTACHED:  # R6
            raise RuntimeError("Could not acquire the IPUs: another executable is attached to them")
        _ATTACHED.append(self)
        self._attached = True

    def _require_compiled(self):
        if not self.isCompiled():
            raise RuntimeError("Model has not been compiled or has been destroyed.")

    def detachFromDevice(self):
        self._require_compiled()
        if not self._attached:  # R5
            raise RuntimeError("Device is not attached")
        _ATTACHED.remove(self)
        self._attached = False

    def copyWeightsToHostIfNeeded(self):
        return False  # the double's weights live on the host

    def copyWeightsToHost(self):
        if not self._attached:
            raise RuntimeError("Device is not attached")

    def setOptimizer(self, optimizer):
        self.optimizer = optimizer

    @property
    def rng_state(self):
        self._require_compiled()  # R7
        return list(self._rng)

    @rng_state.setter
    def rng_state(self, state):
        self._require_compiled()  # R7
        self._rng = list(state)

    def __call__(self, **inputs):
        if not self.isCompiled():
            self.compile(**inputs)
        signature = {k: (tuple(v.shape), v.dtype) for k, v in inputs.items()}
        if signature != self._signature:  # R2
            raise RuntimeError(
                f"Number of arguments mismatch or shapes changed: {signature} vs {self._signature}"
            )
        if not self._attached:
            self.attachToDevice()
        self.calls += 1
        self._rng[1] += 1
        synthetic = self.options._Popart.options.get("syntheticDataMode", 0) != 0  # R14
        if synthetic:
            host_weights = {k: v.clone() for k, v in self.model.state_dict().items()}
        micro = self._micro_batches(inputs)
        per_iteration = len(micro) // self.options.device_iterations
        losses, sums = [], []
        for i in range(self.options.device_iterations):
            group = micro[i * per_iteration : (i + 1) * per_iteration]
            if self.training:
                self.optimizer.zero_grad()
            for batch in group:
                with torch.set_grad_enabled(self.training):
                    loss, s = self.model(**batch)
                if self.training:  # R10: Sum reduction over micro-batches and replicas
                    (loss * self.optimizer.loss_scaling).backward()
                losses.append(loss.detach())
                sums.append(s.detach())
            if self.training:
                params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
                if getattr(self.options, "distributed", False):  # R15
                    import horovod.torch as hvd

                    flat = hvd.allreduce(torch.cat([p.grad.reshape(-1) for p in params]), op=hvd.Sum)
                    for p, g in zip(params, flat.split([p.numel() for p in params])):
                        p.grad.copy_(g.view_as(p.grad))
                divisor = self.optimizer.loss_scaling
                if self.options.Training.reduction == ReductionType.Mean:  # R10
                    instances = hvd_size() if getattr(self.options, "distributed", False) else 1
                    divisor *= len(group) * instances
                for p in params:
                    p.grad /= divisor
                self.optimizer.step()
        if synthetic:  # R14: no weight streams back, output buffers never written
            self.model.load_state_dict(host_weights)
            losses = [torch.full_like(x, float("nan")) for x in losses]
            sums = [torch.full_like(x, float("nan")) for x in sums]
        if self.options.output_mode == OutputMode.Sum:
            return torch.stack(losses).sum(0), torch.stack(sums).sum(0)
        return torch.stack(losses), torch.cat(sums)


def hvd_size() -> int:
    import horovod.torch as hvd

    return hvd.size()


def trainingModel(model, options=None, optimizer=None):
    return PoplarExecutor(model, options or Options(), True, optimizer)


def inferenceModel(model, options=None):
    return PoplarExecutor(model, options or Options(), False)
