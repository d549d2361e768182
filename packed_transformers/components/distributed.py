"""torch.distributed for the torch engines: this process's replica, sums over processes,
the stop flag every replica agrees on, RNG states of every rank, and tear-down.

Host collectives (sums, the stop flag, barriers) go through torch.distributed when a
process group exists; a launcher without one (poprun: the IPU engine's instances talk
through Horovod) registers its own sum with `use_host_sum`, and barriers become a sum
every process must join."""

from __future__ import annotations

import dataclasses
import gc
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from packed_transformers.components import checkpoint as ckpt
from packed_transformers.components.errors import RunError


@dataclass(frozen=True)
class Replicas:
    """This process's place among the run's processes (world 1: a run of one process): every
    job's one replica type (BERT's engines, the decoder, fine-tuning)."""

    rank: int
    world: int
    device: torch.device
    sharding: str  # "none" (replicated: DDP) | "fsdp"

    @property
    def writes(self) -> bool:
        """Rank 0 writes the run's files; the others compute alongside."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.sharding == "fsdp"

    def rows(self, table: np.ndarray, fixed_rows: bool) -> np.ndarray:
        """This rank's rows of a step's batch table [B, K] (-1: no example). fixed_rows (a
        compiled step keeps one shape): every rank gets ceil(B / N) rows, empty ones added."""
        mine = table[self.rank :: self.world]
        rows = -(-len(table) // self.world) if fixed_rows else max(len(mine), 1)
        if len(mine) < rows:
            mine = np.concatenate([mine, np.full((rows - len(mine), table.shape[1]), -1, table.dtype)])
        return mine

    def describe(self) -> str:
        """ "; 2 processes share each step's rows (FSDP2)" under torchrun; "" alone."""
        if self.world == 1:
            return ""
        return f"; {self.world} processes share each step's rows ({'FSDP2' if self.sharded else 'DDP'})"

    def step_sums(self, local: dict[str, float]) -> dict[str, float]:
        """A step's sums (loss_sum, count, ...) over every rank: one collective, float64."""
        if self.world == 1:
            return local
        keys = sorted(local)
        total = all_reduce_host(torch.tensor([local[k] for k in keys], dtype=torch.float64))
        return dict(zip(keys, total.tolist()))  # one total per key (Python 3.8: no strict=)

    def agree(self, flag: bool) -> bool:
        """True on every rank if it is on any (a limit a rank's clock reached, a signal)."""
        return any_process(flag) if self.world > 1 else flag

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


# A run of one process: every method is the plain single-process step.
ONE_PROCESS = Replicas(0, 1, torch.device("cpu"), "none")


def setup_replica(config: dict) -> Replicas:
    """Rank and device from torchrun's environment (rank 0 of 1 without it), and the run's
    execution.sharding; joins the process group when there is more than one process."""
    execution = config["execution"]
    replicas = join_process_group(
        execution["device"], execution["threads"], execution["distributed_backend"], "execution.device"
    )
    return dataclasses.replace(replicas, sharding=execution["sharding"])


def join_process_group(kind: str, threads: int | None, backend: str | None, key: str) -> Replicas:
    """setup_replica for any run: `kind` cpu | cuda (this rank's GPU: LOCAL_RANK), torch's
    CPU threads (None: its default), the backend (None: nccl on CUDA, gloo on CPUs); `key`: the
    config key a refusal names."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if kind == "cuda":
        if not torch.cuda.is_available():
            from packed_transformers.common.cli import no_gpu

            raise RunError(no_gpu(f"{key} cuda", torch.__version__, torch.version.cuda is not None))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if threads:
        torch.set_num_threads(threads)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend or ("nccl" if kind == "cuda" else "gloo"))
    return Replicas(rank, world, device, "none")


def data_parallel(step_model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DDP around what a step calls (the model or its compiled forward): gradients averaged
    over every process once, at a step's last micro-batch (take_step multiplies the loss back)."""
    device_ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(step_model, device_ids=device_ids)


def all_reduce_(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over the process group (all processes by default); a no-op without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, group=group)
    return tensor


_host_sum = None  # a launcher's own sum over processes (no torch.distributed group)


def use_host_sum(sum_over_processes) -> None:
    """Register `sum_over_processes(tensor) -> tensor` for host collectives (None: off)."""
    global _host_sum
    _host_sum = sum_over_processes


def all_reduce_host(values: torch.Tensor) -> torch.Tensor:
    """Sum a host tensor over every process (through the GPU where the backend is NCCL)."""
    if not (dist.is_available() and dist.is_initialized()):
        return _host_sum(values) if _host_sum is not None else values
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    values = values.to(device)
    dist.all_reduce(values)
    return values.cpu()


def max_over_processes(value: int) -> int:
    """The largest `value` of every process (this one's without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([float(value)])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def any_process(flag: bool) -> bool:
    """True on every process if it is True on any (a signal seen by one replica stops all)."""
    return bool(all_reduce_host(torch.tensor([1.0 if flag else 0.0])).item() > 0)


def gather_rng_states() -> list:
    """Every process's RNG state (index = rank), so that each resumes its own stream."""
    mine = ckpt.rng_state()
    if not dist.is_initialized():
        return [mine]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    elif _host_sum is not None:  # every process must join a sum: a barrier
        _host_sum(torch.zeros(1))


def shut_down_process_group() -> None:
    """Tear torch.distributed down before the interpreter exits. Left to interpreter
    shutdown, a gloo group's threads can outlive it: seen once as 'terminate called without
    an active exception' (SIGABRT) in a finished 2-stage pipeline run on a loaded machine."""
    use_host_sum(None)
    if dist.is_available() and dist.is_initialized():
        # DDP modules the run no longer holds but a reference cycle keeps are freed first, while
        # the group's Python object still holds the group: freed later, the last reference would
        # be their Reducer's, whose destructor ends the gloo group with the GIL held and can wait
        # for ever on a gloo thread that needs the GIL (seen in a Trainer run's teardown,
        # tests/ddp_decoder_train.py; torch issues 56297, 190489). The group's own Python object
        # ends it with the GIL released.
        gc.collect()
        dist.destroy_process_group()
