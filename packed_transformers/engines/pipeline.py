"""Torch pipeline backend: the model split into stages by `execution.layers_per_stage`,
one process per stage, GPipe or 1F1B (torch.distributed.pipelining), combined with
data-parallel replicas (pipelines x replicas = WORLD_SIZE under torchrun).

Layout: rank = replica * stages + stage, so one pipeline's stages are neighbouring ranks
(on one host where possible). Stage 0 holds the embeddings, the last stage the pooler and
heads, as on IPUs. Every rank builds the whole model from the same seed (so weights agree
without a broadcast) and moves only its stage to the device.

The step is the torch engine's computation (components.step), spread out:
  * the step's micro-batches (gradient accumulation) are the schedule's micro-batches;
  * the last stage's loss function (`HeadLoss`) runs the heads and normalises each
    micro-batch's sums by the step's global counts: components.step.micro_batch_loss,
    summed by the schedule (scale_grads=False);
  * gradients are summed over replicas (dp group); the MLM decoder weight, tied to the
    word embeddings of stage 0, gets the sum of both stages' gradients (tied group), so
    both copies take the same update;
  * the global gradient norm for clipping is summed over stages, the tied weight once.
Checkpoints hold the whole model and a whole-model optimizer state, whatever the split:
a run saved with 2 stages resumes with 1 (the plain torch engine) or 4.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from packed_transformers.components.data import padded_groups
from packed_transformers.components.distributed import setup_replica
from packed_transformers.components.errors import RunError
from packed_transformers.components.observe import SUM_KEYS, MetricSums, summarize, sums_vector
from packed_transformers.components.step import (
    BatchArithmetic,
    StepLoss,
    loss_scales,
    micro_batch_loss,
    set_learning_rate,
    step_counts,
)
from packed_transformers.engines.engine import Snapshot, StepResult, staged_loss_only
from packed_transformers.model.config import bert_config, nonempty_stage_ranges
from packed_transformers.model.pretraining import HEAD_INPUTS
from packed_transformers.optim import build_lamb

log = logging.getLogger("training.pipeline")

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def stage_ranges(config: dict) -> list[range]:
    """The encoder layers of each stage, from execution.layers_per_stage (none empty)."""
    layers = bert_config(config["model"]["preset"]).num_hidden_layers
    try:
        return nonempty_stage_ranges(layers, config["execution"]["layers_per_stage"])
    except ValueError as err:
        raise RunError(f"execution.layers_per_stage: {err}") from None


class Topology:
    """Where this process sits in the (replicas x stages) grid, and its process groups."""

    def __init__(self, stages: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % stages:
            raise RunError(
                f"execution.layers_per_stage has {stages} stages but torchrun started {world} process(es): "
                f"the number of processes must be a multiple of the stages (one process per stage and replica)"
            )
        self.stages, self.replicas = stages, world // stages
        self.stage, self.replica = rank % stages, rank // stages
        self.pp_group = self.dp_group = self.tied_group = None
        # new_group is collective: every rank creates every group, in the same order.
        for r in range(self.replicas):
            group = dist.new_group([r * stages + s for s in range(stages)])
            if r == self.replica:
                self.pp_group = group
        for s in range(stages):
            group = dist.new_group([r * stages + s for r in range(self.replicas)])
            if s == self.stage:
                self.dp_group = group
        for r in range(self.replicas):
            group = dist.new_group([r * stages, r * stages + stages - 1])
            if r == self.replica:
                self.tied_group = group

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


class StageModule(nn.Module):
    """One stage's part of PackedBertForPreTraining (shared modules, not copies).

    stage 0:  (input_ids, position_ids, segment_ids, sequence_ids) -> layers
    others:   (hidden [B, S, H], sequence_ids as float [B, S]) -> layers
    Not last: returns (hidden, sequence_ids as float) for the next stage (ids travel as
    floats: they carry no gradient). Last: returns sequence_output; its loss function
    runs `heads` (pooler + cls, registered here so that they count as this stage's)."""

    def __init__(self, model, layers: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        object.__setattr__(self, "_bert", model.bert)  # for the mask only: not this stage's weights
        self.embeddings = model.bert.embeddings if first else None
        self.layers = nn.ModuleList(model.bert.encoder.layer[i] for i in layers)
        if last:
            self.pooler, self.cls = model.bert.pooler, model.cls

    def forward(self, *inputs):
        if self.first:
            input_ids, position_ids, segment_ids, sequence_ids = inputs
            hidden = self.embeddings(input_ids.long(), position_ids.long(), segment_ids.long())
        else:
            hidden, sequence_ids = inputs
        mask = self._bert.attention_mask(sequence_ids.long(), hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, mask)
        return hidden if self.last else (hidden, sequence_ids.float())

    def owned_parameters(self) -> set[int]:
        return {id(p) for p in self.parameters()}


class HeadLoss:
    """The last stage's loss function for the schedule: the heads on a micro-batch's
    sequence output, its sums recorded, its share of the step's loss returned.

    `begin(scales)` before a schedule pass; `outputs(n)` after it gives the n
    micro-batches' sums (the schedule's first pass also calls the loss once on the whole
    batch, for shape inference: the micro-batches' calls are the last n)."""

    def __init__(self, model):
        self.model = model
        self.scales = (1.0, 1.0)
        self.head_widths: list[int] = []
        self.recorded: list[dict] = []

    def begin(self, scales: tuple[float, float], batch: dict) -> None:
        self.scales, self.recorded = scales, []
        self.head_widths = [batch[name].shape[1] for name in HEAD_INPUTS]

    def __call__(self, sequence_output, target):
        fields = torch.split(target, self.head_widths, dim=1)
        out = self.model.heads(sequence_output, *fields)
        self.recorded.append({k: out[k].detach() for k in SUM_KEYS[:-1]})
        return micro_batch_loss(out["mlm_loss_sum"], out["nsp_loss_sum"], *self.scales)

    def outputs(self, micro_batches: int) -> list[dict]:
        calls = len(self.recorded)
        if calls not in (micro_batches, micro_batches + 1):
            raise RuntimeError(f"the schedule computed {calls} losses for {micro_batches} micro-batches")
        return self.recorded[calls - micro_batches :]


class PipelineEngine:
    """engines.engine.Engine for pipelined (x replicated) torch training."""

    steps_per_call = 1

    @staticmethod
    def check_config(config: dict) -> None:
        """The stage split, the loss mode and the precision a torch pipeline runs with."""
        stage_ranges(config)
        if config["model"]["mlm_loss_mode"] != "per_token":
            raise RunError("model.mlm_loss_mode: the torch pipeline supports per_token")
        if config["training"]["on_nonfinite"] == "skip":
            raise RunError(
                "training.on_nonfinite skip: the pipeline engine checks the loss once per logging window, "
                "after the optimizer stepped, so it cannot skip a step; use stop"
            )
        if config["training"]["compile"] or config["training"]["precision"] == "fp16":
            raise RunError(
                "the torch pipeline runs fp32 or bf16 without torch.compile (training.compile, precision)"
            )

    def __init__(self, config: dict):
        self.config = config
        split = config["execution"]["layers_per_stage"]
        self.ranges = stage_ranges(config)
        self.replica_info = setup_replica(config)
        if not dist.is_initialized():
            raise RunError(
                f"execution.layers_per_stage {split} needs one process per stage: start with "
                f"torchrun --nproc-per-node {len(split)} run_pretraining.py ..."
            )
        self.topology = Topology(len(split))
        self.rank = dist.get_rank()
        self.data_rank, self.data_world = self.topology.replica, self.topology.replicas
        self.device = self.replica_info.device

    def attach(self, model, packing_factor: float) -> BatchArithmetic:
        cfg, topo = self.config, self.topology
        batch = BatchArithmetic.from_config(cfg, packing_factor, topo.replicas)
        self.model = model
        # The optimizer covers the whole model (whole-model checkpoints); only this
        # stage's parameters ever get gradients, so only they take steps and hold state.
        # It does not clip: the global norm spans stages (_clip).
        self.max_grad_norm = cfg["optim"]["max_grad_norm"]
        self.optimizer = build_lamb(model, cfg["optim"], batch.betas, max_grad_norm=None)
        self.micro_batches_per_call = batch.gradient_accumulation
        schedule_name = cfg["execution"]["pipeline_schedule"]
        if schedule_name == "1f1b" and batch.gradient_accumulation < topo.stages:
            raise RunError(
                f"execution.pipeline_schedule 1f1b needs at least as many micro-batches per step (gradient "
                f"accumulation {batch.gradient_accumulation}, after the packing adjustment) as stages "
                f"({topo.stages}); raise optim.gradient_accumulation or use gpipe"
            )
        self.stage_module = StageModule(model, self.ranges[topo.stage], topo.first, topo.last).to(self.device)
        model.train()
        self.owned = self.stage_module.owned_parameters()
        self.tied = model.bert.embeddings.word_embeddings.weight
        self.stage = PipelineStage(
            self.stage_module, topo.stage, topo.stages, self.device, group=topo.pp_group
        )
        self.head_loss = HeadLoss(model)
        self.schedule = SCHEDULES[schedule_name](
            self.stage, batch.gradient_accumulation, loss_fn=self.head_loss, scale_grads=False
        )
        if self.rank == 0:
            log.info(
                "pipeline: %d stages x %d replicas, layers %s, %s schedule, %d micro-batches per step",
                topo.stages,
                topo.replicas,
                cfg["execution"]["layers_per_stage"],
                schedule_name,
                batch.gradient_accumulation,
            )
        return batch

    def _run(self, micro_batches, scales: tuple[float, float], train: bool) -> list[torch.Tensor]:
        """One schedule pass over a step's micro-batches (forward+backward or forward) -> the
        last stage's SUM_KEYS vector of each (components.observe.sums_vector); the others' []."""
        batch = {k: torch.cat([b[k] for b in micro_batches]).to(self.device) for k in micro_batches[0]}
        self.head_loss.begin(scales, batch)
        args = ()
        if self.topology.first:
            args = (batch["input_ids"], batch["position_ids"], batch["segment_ids"], batch["sequence_ids"])
        target = _pack_heads(batch) if self.topology.last else None
        run = self.schedule.step if train else self.schedule.eval
        run(*args, target=target, losses=[] if self.topology.last else None)
        if not self.topology.last:
            return []
        outputs = self.head_loss.outputs(len(micro_batches))
        return [
            sums_vector(out, int((b["sequence_ids"] > 0).sum())) for out, b in zip(outputs, micro_batches)
        ]

    def step(self, micro_batches, loss: StepLoss, lr: float) -> StepResult:
        staged_loss_only("pipeline", loss)
        counts = step_counts(micro_batches, "per_token", self.device, self.topology.dp_group)
        kept = self._run(micro_batches, loss_scales(counts), train=True)
        self._sync_gradients()
        self._clip()
        set_learning_rate(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(counts, None, kept)

    def _sync_gradients(self):
        topo = self.topology
        params = [p for p in self.stage_module.parameters() if p.grad is not None]
        if topo.replicas > 1:
            for p in params:
                dist.all_reduce(p.grad, group=topo.dp_group)
        if topo.stages > 1 and (topo.first or topo.last):
            if self.tied.grad is None:  # e.g. no masked token in the step
                self.tied.grad = torch.zeros_like(self.tied)
            dist.all_reduce(self.tied.grad, group=topo.tied_group)

    def _clip(self):
        """Lamb's global-norm clipping over all stages, the tied weight counted once."""
        if self.max_grad_norm is None:
            return
        topo = self.topology
        grads = [
            p.grad
            for p in self.stage_module.parameters()
            if p.grad is not None and not (topo.last and topo.stages > 1 and p is self.tied)
        ]
        squares = (
            torch.stack([g.double().pow(2).sum() for g in grads]).sum()
            if grads
            else torch.zeros((), dtype=torch.float64, device=self.device)
        )
        dist.all_reduce(squares, group=topo.pp_group)
        scale = min(1.0, self.max_grad_norm / max(squares.sqrt().item(), 1e-12))
        if scale < 1.0:
            for p in self.stage_module.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)

    @torch.no_grad()
    def evaluate(self, shards, batches) -> dict:
        self.stage_module.eval()
        sums = MetricSums()
        micro = self.micro_batches_per_call
        # Every pipeline must make the same number of schedule passes.
        per_replica = torch.tensor([len(batches)], device=self.device)
        dist.all_reduce(per_replica, op=dist.ReduceOp.MAX)
        passes = -(-int(per_replica.item()) // micro)
        rows = self.config["data"]["micro_batch_packs"]
        for group in padded_groups(shards, batches, micro, rows, groups=passes):
            for vector in self._run(group, (0.0, 0.0), train=False):
                sums.add_vector(vector)
        self.stage_module.train()
        return summarize(sums.reduce())

    def reduce(self, sums: MetricSums) -> dict:
        return sums.reduce()  # only last stages hold sums; the others add zeros

    # ----- whole-model checkpoints ------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """Collective: rank 0 gets every stage's weights (into its whole model) and a
        whole-model optimizer state, the same format the plain torch engine writes."""
        mine_weights = {n: p.detach().cpu() for n, p in self.model.named_parameters() if id(p) in self.owned}
        full = self.optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        owned_index = {index[i] for i in self.owned if i in index}
        mine_state = {
            i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in full["state"].items()
            if i in owned_index
        }
        gathered = [None] * dist.get_world_size() if self.rank == 0 else None
        # Replica 0's stages are ranks 0..stages-1; other replicas hold identical copies.
        dist.gather_object((self.topology.replica, mine_weights, mine_state), gathered, dst=0)
        if self.rank != 0:
            return Snapshot(None, None)
        merged_state = {}
        with torch.no_grad():
            named = dict(self.model.named_parameters())
            for replica, weights, state in gathered:
                if replica != 0:
                    continue
                for n, w in weights.items():
                    named[n].copy_(w.to(named[n].device))
                merged_state.update(state)
        # The whole model's clipping setting (this engine clips by hand, across stages).
        return Snapshot(
            self.model, {"optimizer": {**full, "state": merged_state, "max_grad_norm": self.max_grad_norm}}
        )

    def load_state(self, engine_state: dict, path=None) -> None:
        if "optimizer" not in engine_state:  # a sharded run's: its optimizer is in dcp/
            raise RunError(f"--resume: {path} keeps its optimizer as a sharded run's dcp/ shards, which the pipeline engine "
                           "does not read: resume it on the torch engine (execution.device cpu or cuda)")  # fmt: skip
        self.optimizer.load_state_dict(engine_state["optimizer"])
        self.optimizer.max_grad_norm = None  # clipped by hand across stages (_clip)
        # Keep only this stage's moments (the file holds the whole model's).
        for p in list(self.optimizer.state):
            if id(p) not in self.owned:
                del self.optimizer.state[p]


def _pack_heads(batch: dict) -> torch.Tensor:
    """The heads' six int fields side by side, [B, 3M + 3K]: the schedule's `target` is
    one tensor, split into micro-batches along dim 0 like the inputs."""
    return torch.cat([batch[name].long() for name in HEAD_INPUTS], dim=1)
