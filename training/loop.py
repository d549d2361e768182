"""The torch training loop: one place for the step (`train_step`), evaluation and the run.

A batch goes: packed shard rows (training.data) -> dict of [B, S] / [B, M] / [B, K]
int tensors -> PackedBertForPreTraining -> sums and counts -> loss normalised by the
step's GLOBAL masked-token and sequence counts -> backward -> LAMB step. Normalising by
global counts makes 1 replica x GA micro-batches and GA replicas x 1 micro-batch the
same computation (up to float summation order).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

from model import PackedBertForPreTraining, validate_batch
from packing.io_utils import atomic_path
from training import checkpoint as ckpt
from training.build import (
    RunError,
    build_model,
    build_optimizer,
    build_schedule,
    check_model_fits_data,
    mlperf_eval_interval,
    open_packed,
    packing_factor,
)
from training.data import LoaderPosition, PackedShards, ReplicaSampler, advance, eval_batches, make_loader
from training.observe import MetricSums, Reporter, summarize

log = logging.getLogger("training")
EXIT_INTERRUPTED = 143


@dataclass
class RunState:
    """Everything besides weights and optimizer that a checkpoint restores."""

    step: int = 0
    samples: int = 0  # real sequences trained on, all replicas
    position: LoaderPosition = field(default_factory=LoaderPosition)
    next_eval_samples: int = 0
    best_eval_accuracy: float = 0.0
    reached_target: bool = False


# --------------------------------------------------------------------------------------
# Distributed setup
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Replica:
    rank: int
    world: int
    local_rank: int
    device: torch.device


def setup_replica(config: dict) -> Replica:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    kind = config["execution"]["device"]
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RunError("execution.device is cuda but torch sees no CUDA device")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if config["execution"]["threads"]:
        torch.set_num_threads(config["execution"]["threads"])
    if world > 1 and not dist.is_initialized():
        backend = config["execution"]["distributed_backend"] or ("nccl" if kind == "cuda" else "gloo")
        dist.init_process_group(backend=backend)
    return Replica(rank, world, local_rank, device)


def all_reduce_(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over the process group (all processes by default); a no-op without torch.distributed."""
    if dist.is_initialized():
        dist.all_reduce(tensor, group=group)
    return tensor


# --------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------
def autocast_context(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def step_counts(micro_batches: list[dict], mode: str, device, group=None) -> torch.Tensor:
    """[masked tokens, sequences] of this replica's micro-batches, all-reduced over replicas
    (`group`: the data-parallel group where processes are not all replicas, e.g. pipelines).

    In per_sequence MLM mode the first entry counts sequences with a masked token."""
    mlm = 0
    for batch in micro_batches:
        weights = batch["masked_lm_weights"]
        if mode == "per_sequence":
            k = batch["next_sentence_weights"].shape[1]
            mlm += sum(int((weights == j).any(dim=1).sum()) for j in range(1, k + 1))
        else:
            mlm += int((weights > 0).sum())
    nsp = sum(int(b["next_sentence_weights"].sum()) for b in micro_batches)
    return all_reduce_(torch.tensor([mlm, nsp], dtype=torch.float64, device=device), group).cpu()


def train_step(model, optimizer, scaler, micro_batches, lr, precision, device, world, mode, sums: MetricSums):
    """One optimizer step over this replica's micro-batches. Returns the step's global counts."""
    counts = step_counts(micro_batches, mode, device)
    mlm_total, nsp_total = max(counts[0].item(), 1.0), max(counts[1].item(), 1.0)
    loss_key = "mlm_sequence_loss_sum" if mode == "per_sequence" else "mlm_loss_sum"
    for i, host_batch in enumerate(micro_batches):
        batch = {k: v.to(device, non_blocking=True) for k, v in host_batch.items()}
        last = i == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with autocast_context(precision, device):
                out = model(**batch)
            # DDP averages gradients over replicas; * world turns that into a global sum.
            loss = (out[loss_key] / mlm_total + out["nsp_loss_sum"] / nsp_total) * world
            scaler.scale(loss).backward()
        sums.add(out, int((host_batch["sequence_ids"] > 0).sum()))  # host tensor: no device sync
    for group in optimizer.param_groups:
        group["lr"] = lr
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return counts


@torch.no_grad()
def evaluate(model, shards, batches, device, precision) -> dict:
    """Exact eval metrics (token and sequence counts) over this replica's batches, all-reduced."""
    was_training = model.training
    model.eval()
    sums = MetricSums()
    for packs in batches:
        host_batch = shards[packs]
        batch = {k: v.to(device) for k, v in host_batch.items()}
        with autocast_context(precision, device):
            out = model(**batch)
        sums.add(out, int((host_batch["sequence_ids"] > 0).sum()))
    model.train(was_training)
    return summarize(sums.all_reduce())


# --------------------------------------------------------------------------------------
# Stopping and output
# --------------------------------------------------------------------------------------
class _Stop:
    """SIGTERM / SIGINT -> finish the current step, checkpoint, exit."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True


def prepare_output(output: Path, config: dict, resume: bool, rank: int) -> None:
    saved = output / "config.yaml"
    if saved.is_file():
        if not resume:
            raise RunError(
                f"--output-dir {output} holds another run (config.yaml); pass --resume to continue it "
                "or choose another directory"
            )
        previous = yaml.safe_load(saved.read_text())
        for section in ("model", "data", "optim"):
            if previous.get(section) != config[section]:
                raise RunError(
                    f"--resume: section '{section}' differs from the run in {output}; only training/eval/"
                    "logging/execution settings may change on resume"
                )
    elif output.is_dir() and any(output.iterdir()) and not resume:
        raise RunError(f"--output-dir {output} is not empty and holds no run")
    # Every rank checks before rank 0 writes: otherwise a slower rank finds the config.yaml
    # rank 0 just wrote and refuses the folder as "another run".
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        with atomic_path(saved) as tmp:
            tmp.write_text(yaml.safe_dump(config, sort_keys=False))


# --------------------------------------------------------------------------------------
# The torch engine: one process = one data-parallel replica
# --------------------------------------------------------------------------------------
class TorchEngine:
    """What the run needs from a backend, for torch on CPU/CUDA with DDP under torchrun.

    The run (run_training) only calls what every engine has:
      rank, data_rank, data_world   who writes (rank 0) and which share of the data is read
      micro_batches_per_call         micro-batches this process feeds to one `train` call
      steps_per_call                 optimizer steps one `train` call makes
      attach(model, factor)          -> (adjusted hyperparameters, StepShape)
      train(micro_batches, lr, sums) -> the call's global [masked tokens, sequences]
      evaluate(shards, batches)      -> exact eval metrics, reduced over replicas
      reduce(sums)                   -> metric sums of all replicas
      state() / load_state(saved)    optimizer (+ scaler) state for checkpoints
      host_model()                   the whole model with current weights, for saving
    """

    steps_per_call = 1

    def __init__(self, config: dict):
        self.config = config
        self.replica = setup_replica(config)
        self.rank = self.data_rank = self.replica.rank
        self.data_world = self.replica.world

    def attach(self, model: PackedBertForPreTraining, factor: float):
        t = self.config["training"]
        self.model = model
        self.optimizer, adjusted, shape = build_optimizer(model, self.config, factor, self.replica.world)
        self.micro_batches_per_call = shape.gradient_accumulation
        model.to(self.replica.device)
        model.train()
        self.step_model = torch.compile(model) if t["compile"] else model
        if self.replica.world > 1:
            device_ids = [self.replica.device.index] if self.replica.device.type == "cuda" else None
            self.step_model = torch.nn.parallel.DistributedDataParallel(
                self.step_model, device_ids=device_ids
            )
        self.scaler = torch.amp.GradScaler(self.replica.device.type, enabled=t["precision"] == "fp16")
        return adjusted, shape

    def train(self, micro_batches, lr, sums: MetricSums) -> torch.Tensor:
        return train_step(
            self.step_model,
            self.optimizer,
            self.scaler,
            micro_batches,
            lr,
            self.config["training"]["precision"],
            self.replica.device,
            self.replica.world,
            self.config["model"]["mlm_loss_mode"],
            sums,
        )

    def evaluate(self, shards, batches) -> dict:
        return evaluate(
            self.model, shards, batches, self.replica.device, self.config["training"]["precision"]
        )

    def reduce(self, sums: MetricSums) -> dict:
        return sums.all_reduce()

    def state(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state(self, saved: dict) -> None:
        self.optimizer.load_state_dict(saved["optimizer"])
        if "scaler" in saved:
            self.scaler.load_state_dict(saved["scaler"])

    def host_model(self) -> PackedBertForPreTraining:
        return self.model


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------
def run_training(config: dict, output: Path, resume: bool = False, engine_class=TorchEngine) -> int:
    """The whole run on this process. Returns the process exit code.

    `engine_class` is the backend (TorchEngine here; the IPU and torch-pipeline backends
    pass theirs): data order, evaluation schedule, checkpoints, logging and stopping are
    the same for every backend and live only here."""
    t = config["training"]
    # All user-input checks first: data, output folder, model, before any compute.
    train_data = open_packed(config["data"]["train_dir"], config, "train")
    eval_data = (
        open_packed(config["data"]["eval_dir"], config, "eval") if config["data"]["eval_dir"] else None
    )
    engine = engine_class(config)
    prepare_output(output, config, resume, engine.rank)
    model = build_model(config, t["seed"])
    check_model_fits_data(model, train_data)
    factor = packing_factor(train_data)
    state = RunState()
    checkpoints = output / "checkpoints"
    restored = ckpt.latest_valid_checkpoint(checkpoints) if resume else None
    saved = None
    if restored is not None:
        saved = ckpt.load_training_state(restored)
        model.load_state_dict(PackedBertForPreTraining.from_pretrained(restored / "model").state_dict())
    adjusted, shape = engine.attach(model, factor)
    schedule = build_schedule(config)
    if saved is not None:
        engine.load_state(saved)
        state = RunState(
            step=saved["step"],
            samples=saved["samples"],
            position=LoaderPosition(**saved["position"]),
            next_eval_samples=saved["next_eval_samples"],
            best_eval_accuracy=saved["best_eval_accuracy"],
        )
        ckpt.set_rng_state(saved["rng"][engine.rank] if engine.rank < len(saved["rng"]) else saved["rng"][0])

    shards = PackedShards(train_data)
    sampler = ReplicaSampler(
        len(shards),
        shape.micro_batch_packs,
        config["data"]["shuffle_seed"],
        engine.data_rank,
        engine.data_world,
        state.position,
    )
    loader = iter(make_loader(shards, sampler, config["data"]["loader_workers"]))
    eval_every = config["eval"]["every_samples"] or mlperf_eval_interval(shape.sequences_per_step)
    if state.next_eval_samples == 0:
        state.next_eval_samples = int(eval_every)
    eval_set = (
        eval_batches(
            eval_data,
            shape.micro_batch_packs,
            config["eval"]["max_sequences"],
            engine.data_rank,
            engine.data_world,
        )
        if eval_data
        else None
    )

    reporter = Reporter(output, config, engine.rank)
    stop = _Stop()
    if engine.rank == 0:
        log.info(adjusted.describe())
        log.info(
            "step = %d replicas x %d micro-batches x %d packs = %d packs (~%.0f sequences); eval every %d sequences",
            shape.replicas,
            shape.gradient_accumulation,
            shape.micro_batch_packs,
            shape.packs_per_step,
            shape.sequences_per_step,
            eval_every,
        )
        reporter.mlperf("RUN_START")
        reporter.mlperf("GLOBAL_BATCH_SIZE", value=shape.sequences_per_step)
    progress = tqdm(
        total=t["max_steps"],
        initial=state.step,
        unit="step",
        dynamic_ncols=True,
        disable=engine.rank != 0 or not config["logging"]["progress"],
    )
    status, started, window = "aborted", time.perf_counter(), MetricSums()
    window_start, window_samples = time.perf_counter(), 0

    def save():
        training_state = {
            **engine.state(),
            "step": state.step,
            "samples": state.samples,
            "position": state.position.as_dict(),
            "next_eval_samples": state.next_eval_samples,
            "best_eval_accuracy": state.best_eval_accuracy,
            "rng": gather_rng_states(),
            "config": config,
        }
        if engine.rank == 0:
            path = ckpt.save_checkpoint(
                checkpoints, state.step, engine.host_model(), training_state, t["keep_checkpoints"]
            )
            log.info("checkpoint %s", path)
        if dist.is_initialized():
            dist.barrier()

    def run_eval() -> bool:
        if eval_set is None:
            return False
        shards_eval, batches, covered = eval_set
        metrics = engine.evaluate(shards_eval, batches)
        state.best_eval_accuracy = max(state.best_eval_accuracy, metrics["mlm_accuracy"])
        reporter.log({"step": state.step, "samples": state.samples, **metrics}, "eval")
        reporter.mlperf("EVAL_ACCURACY", value=metrics["mlm_accuracy"], metadata={"epoch_num": state.samples})
        if engine.rank == 0:
            progress.write(
                f"eval at {state.samples} sequences: MLM accuracy {metrics['mlm_accuracy']:.4f} "
                f"over {metrics['masked_tokens']} masked tokens of {metrics['sequences']} sequences"
            )
        return metrics["mlm_accuracy"] >= config["eval"]["target_mlm_accuracy"]

    exit_code = 0
    try:
        while state.step < t["max_steps"]:
            if t["max_samples"] is not None and state.samples >= t["max_samples"]:
                break
            if t["max_seconds"] is not None and time.perf_counter() - started >= t["max_seconds"]:
                break
            micro_batches = [next(loader) for _ in range(engine.micro_batches_per_call)]
            if config["data"]["validate_batches"]:
                for batch in micro_batches:
                    validate_batch(batch, model.config.vocab_size, model.config.max_position_embeddings)
            lr = schedule(state.samples)
            counts = engine.train(micro_batches, lr, window)
            state.step += engine.steps_per_call
            state.samples += int(counts[1].item())
            window_samples += int(counts[1].item())
            state.position = advance(
                state.position, engine.micro_batches_per_call * engine.data_world, sampler.per_epoch
            )
            progress.update(engine.steps_per_call)
            if state.step % t["log_every_steps"] < engine.steps_per_call or state.step >= t["max_steps"]:
                totals = engine.reduce(window)
                seconds = time.perf_counter() - window_start
                record = {
                    "step": state.step,
                    "samples": state.samples,
                    "epoch": state.position.epoch,
                    "lr": lr,
                    **summarize(totals),
                    "sequences_per_second": window_samples / seconds,
                    "tokens_per_second": totals["tokens"] / seconds,
                }
                reporter.log(record)
                progress.set_postfix(
                    loss=f"{record['loss']:.3f}",
                    mlm_acc=f"{record['mlm_accuracy']:.3f}",
                    seq_s=f"{record['sequences_per_second']:.1f}",
                    tok_s=f"{record['tokens_per_second']:.0f}",
                )
                window, window_start, window_samples = MetricSums(), time.perf_counter(), 0
            if state.samples >= state.next_eval_samples:
                while state.next_eval_samples <= state.samples:
                    state.next_eval_samples += int(eval_every)
                if run_eval() and config["eval"]["stop_at_target"]:
                    state.reached_target = True
                    status = "success"
                    break
            every = t["checkpoint_every_steps"]
            if every and state.step % every < engine.steps_per_call:
                save()
            if stop_requested(stop):
                log.warning("stop requested (signal): checkpointing at step %d", state.step)
                exit_code = EXIT_INTERRUPTED
                break
        if exit_code == 0 and not state.reached_target and config["eval"]["at_end"] and eval_set is not None:
            if run_eval() and config["eval"]["stop_at_target"]:
                state.reached_target = True
                status = "success"
        save()
    finally:
        progress.close()
        reporter.mlperf("RUN_STOP", metadata={"status": status}, end=True)
        reporter.log(
            {
                "step": state.step,
                "samples": state.samples,
                "status": status,
                "seconds": time.perf_counter() - started,
            },
            "end",
        )
        reporter.close()
    return exit_code


def stop_requested(stop: _Stop) -> bool:
    """Any replica's signal stops all of them at the same step."""
    flag = torch.tensor([1.0 if stop.requested else 0.0])
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag)
    return bool(flag.item() > 0)


def gather_rng_states() -> list:
    """Every replica's RNG state (index = rank), so that each resumes its own stream."""
    mine = ckpt.rng_state()
    if not dist.is_initialized():
        return [mine]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states
