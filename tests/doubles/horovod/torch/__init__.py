"""A test double of horovod.torch (0.24) for the IPU engine's poprun instances: tests only.

Processes meet through a torch.distributed TCPStore (not a process group: under poprun
there is none, and the run must not find one). Rules encoded, from horovod/torch/mpi_ops.py
and horovod/common/operations.cc:
H1 every collective before init() raises ValueError("Horovod has not been initialized; use
   hvd.init().").
H2 allreduce's default op is Average; Sum as asked. Version 0.24.0 (requirements-ipu.txt)
   exports Average, Sum and Adasum only (horovod/torch/mpi_ops.py at v0.24.0; Min, Max and
   Product came in 0.26.0, CHANGELOG / PR 3660): this double has no Min or Max either, so
   code that names them fails here as it would on the pinned Horovod (AttributeError).
H5 allgather(tensor) concatenates every process's tensor along dim 0, in rank order
   (horovod/torch/mpi_ops.py allgather; first dimensions may differ, the rest must match).
H3 collectives are matched across processes in submission order; a tensor of another
   shape or dtype at the same position is an error ("Mismatched allreduce tensor shapes").
H4 allreduce returns a new tensor and leaves its input unchanged.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import numpy as np
import torch

Average, Sum, Adasum = "Average", "Sum", "Adasum"  # H2: no Min / Max in 0.24

_state: dict = {}


def init() -> None:
    from torch.distributed import TCPStore

    rank, size = int(os.environ["DOUBLE_POPDIST_INSTANCE"]), int(os.environ["DOUBLE_POPDIST_INSTANCES"])
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        size,
        rank == 0,
        timeout=timedelta(seconds=120),
    )
    _state.update(store=store, rank=rank, size=size, calls=0)
    # Tests make one instance late after joining (a loaded host): its peers must not get
    # ahead of it through the run's barriers.
    time.sleep(float(os.environ.get("DOUBLE_HOROVOD_LATE_SECONDS", "0")))


def _require_init():
    if "store" not in _state:  # H1
        raise ValueError("Horovod has not been initialized; use hvd.init().")


def rank() -> int:
    _require_init()
    return _state["rank"]


def size() -> int:
    _require_init()
    return _state["size"]


def _exchange(tensor: torch.Tensor, kind: str, same_shape: bool) -> list[torch.Tensor]:
    """Every process's tensor for this collective, in rank order (H3)."""
    store, me, n = _state["store"], _state["rank"], _state["size"]
    call = _state["calls"]
    _state["calls"] += 1
    values = tensor.detach().cpu().contiguous()
    header = f"{kind}|{tuple(values.shape) if same_shape else tuple(values.shape[1:])}|{values.dtype}"
    store.set(f"{call}/{me}/header", header)
    store.set(f"{call}/{me}/shape", ",".join(map(str, values.shape)))
    store.set(f"{call}/{me}/data", values.numpy().tobytes())
    parts = []
    for other in range(n):
        theirs = store.get(f"{call}/{other}/header").decode()
        if theirs != header:  # H3
            raise RuntimeError(f"Mismatched {kind} tensor shapes: {header} on rank {me}, {theirs} on {other}")
        shape = tuple(int(x) for x in store.get(f"{call}/{other}/shape").decode().split(",") if x)
        data = np.frombuffer(store.get(f"{call}/{other}/data"), dtype=values.numpy().dtype)
        parts.append(torch.from_numpy(data.copy()).reshape(shape))
    return parts


def allgather(tensor: torch.Tensor, name=None) -> torch.Tensor:
    _require_init()
    return torch.cat(_exchange(tensor, "allgather", same_shape=False))  # H5


def allreduce(tensor: torch.Tensor, average=None, name=None, op=None) -> torch.Tensor:
    _require_init()
    op = op or (Sum if average is False else Average)  # H2
    n = _state["size"]
    stacked = torch.stack(_exchange(tensor, "allreduce", same_shape=True))
    if op == Sum:
        out = stacked.sum(0)
    elif op == Average:
        out = stacked.sum(0) / n
    else:
        raise ValueError(f"op {op} is not supported by this double")
    return out.to(tensor.dtype)  # H4: a new tensor
