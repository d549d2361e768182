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
from training import checkpoint as ckpt
from training.build import (
    RunError,
    build_model,
    build_optimizer,
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


def all_reduce_(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


# --------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------
def autocast_context(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def step_counts(micro_batches: list[dict], mode: str, device) -> torch.Tensor:
    """[masked tokens, sequences] of this replica's micro-batches, all-reduced over replicas.

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
    return all_reduce_(torch.tensor([mlm, nsp], dtype=torch.float64, device=device)).cpu()


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
# The run
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
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        tmp = output / ".config.yaml.tmp"
        tmp.write_text(yaml.safe_dump(config, sort_keys=False))
        os.replace(tmp, saved)


def run_training(config: dict, output: Path, resume: bool = False) -> int:
    """The whole run on this process (one replica). Returns the process exit code."""
    t = config["training"]
    # All user-input checks first: data, output folder, model, before any compute.
    train_data = open_packed(config["data"]["train_dir"], config, "train")
    eval_data = (
        open_packed(config["data"]["eval_dir"], config, "eval") if config["data"]["eval_dir"] else None
    )
    replica = setup_replica(config)
    prepare_output(output, config, resume, replica.rank)
    model = build_model(config, t["seed"])
    check_model_fits_data(model, train_data)
    factor = packing_factor(train_data)
    optimizer, schedule, adjusted, shape = build_optimizer(model, config, factor, replica.world)
    state = RunState()
    checkpoints = output / "checkpoints"
    restored = ckpt.latest_valid_checkpoint(checkpoints) if resume else None
    if restored is not None:
        saved = ckpt.load_training_state(restored)
        weights = PackedBertForPreTraining.from_pretrained(restored / "model").state_dict()
        model.load_state_dict(weights)
        optimizer.load_state_dict(saved["optimizer"])
        state = RunState(
            step=saved["step"],
            samples=saved["samples"],
            position=LoaderPosition(**saved["position"]),
            next_eval_samples=saved["next_eval_samples"],
            best_eval_accuracy=saved["best_eval_accuracy"],
        )
        ckpt.set_rng_state(
            saved["rng"][replica.rank] if replica.rank < len(saved["rng"]) else saved["rng"][0]
        )
    model.to(replica.device)
    model.train()
    step_model = model
    if t["compile"]:
        step_model = torch.compile(model)
    if replica.world > 1:
        step_model = torch.nn.parallel.DistributedDataParallel(
            step_model, device_ids=[replica.device.index] if replica.device.type == "cuda" else None
        )
    scaler = torch.amp.GradScaler(replica.device.type, enabled=t["precision"] == "fp16")
    if restored is not None and "scaler" in saved:
        scaler.load_state_dict(saved["scaler"])

    shards = PackedShards(train_data)
    sampler = ReplicaSampler(
        len(shards),
        shape.micro_batch_packs,
        config["data"]["shuffle_seed"],
        replica.rank,
        replica.world,
        state.position,
    )
    loader = iter(make_loader(shards, sampler, config["data"]["loader_workers"]))
    eval_every = config["eval"]["every_samples"] or mlperf_eval_interval(shape.sequences_per_step)
    if state.next_eval_samples == 0:
        state.next_eval_samples = int(eval_every)
    eval_set = (
        eval_batches(
            eval_data, shape.micro_batch_packs, config["eval"]["max_sequences"], replica.rank, replica.world
        )
        if eval_data
        else None
    )

    reporter = Reporter(output, config, replica.rank)
    stop = _Stop()
    if replica.rank == 0:
        log.info(adjusted.describe())
        log.info(
            "step = %d replicas x %d micro-batches x %d packs = %d packs (~%.0f sequences); eval every %d sequences",
            replica.world,
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
        disable=replica.rank != 0 or not config["logging"]["progress"],
    )
    status, started, window = "aborted", time.perf_counter(), MetricSums()
    window_start, window_samples = time.perf_counter(), 0

    def save():
        training_state = {
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
            "step": state.step,
            "samples": state.samples,
            "position": state.position.as_dict(),
            "next_eval_samples": state.next_eval_samples,
            "best_eval_accuracy": state.best_eval_accuracy,
            "rng": gather_rng_states(),
            "config": config,
        }
        if replica.rank == 0:
            path = ckpt.save_checkpoint(checkpoints, state.step, model, training_state, t["keep_checkpoints"])
            log.info("checkpoint %s", path)
        if dist.is_initialized():
            dist.barrier()

    def run_eval() -> bool:
        if eval_set is None:
            return False
        shards_eval, batches, covered = eval_set
        metrics = evaluate(model, shards_eval, batches, replica.device, t["precision"])
        state.best_eval_accuracy = max(state.best_eval_accuracy, metrics["mlm_accuracy"])
        reporter.log({"step": state.step, "samples": state.samples, **metrics}, "eval")
        reporter.mlperf("EVAL_ACCURACY", value=metrics["mlm_accuracy"], metadata={"epoch_num": state.samples})
        if replica.rank == 0:
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
            micro_batches = [next(loader) for _ in range(shape.gradient_accumulation)]
            if config["data"]["validate_batches"]:
                for batch in micro_batches:
                    validate_batch(batch, model.config.vocab_size, model.config.max_position_embeddings)
            lr = schedule(state.samples)
            counts = train_step(
                step_model,
                optimizer,
                scaler,
                micro_batches,
                lr,
                t["precision"],
                replica.device,
                replica.world,
                config["model"]["mlm_loss_mode"],
                window,
            )
            state.step += 1
            state.samples += int(counts[1].item())
            window_samples += int(counts[1].item())
            state.position = advance(
                state.position, shape.gradient_accumulation * replica.world, sampler.per_epoch
            )
            progress.update(1)
            if state.step % t["log_every_steps"] == 0 or state.step == t["max_steps"]:
                totals = window.all_reduce()
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
            if t["checkpoint_every_steps"] and state.step % t["checkpoint_every_steps"] == 0:
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
