"""A run's checkpoint as every job takes it: one manager of its Stateful parts, over
components.checkpoint's folder format (step-N/: model/, training_state.pt, dcp/, the manifest)
and resume policy. Above checkpoint, distributed and run_state (which import one another's
parts); the jobs (training/, finetune/) import it, nothing in components does.

A part of a run that a checkpoint keeps saves and loads its own state (`Stateful`, as
torch.distributed.checkpoint's and torchtitan's CheckpointManager take theirs): the run state
with the job's progress and data position (components.run_state.RunState: "state"), every
rank's RNG (`RngStates`: "rng") and the engine (engines.engine.Snapshot: model/, dcp/ where
sharded, and its entries, the optimizer's and the loss scaler's). training_state.pt is the
parts' entries together.

    parts = (run_state, RngStates(rank))
    ckpt_run.write_checkpoint(folder, parts, keep, snapshot, rank)   # the engine's Snapshot
    path, saved = ckpt_run.restore(folder, load_into_run, parts)   # the engine's load: load_into_run
    ckpt_run.load_model_weights(model, path, replicas)   # every job's one weight loader
    # a pretraining run's --resume (BERT's on every engine, the decoder's), refusals as RunError:
    path, saved = ckpt_run.resume_pretraining(output, load_into_run, parts, rank)
    ckpt_run.forget_lines_after(output, state.step, rank)   # once the resume's checks passed
    ckpt_run.remove_half_written(folder, rank)   # fine-tuning's, before its resume is read
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from packed_transformers.components import checkpoint as ckpt
from packed_transformers.components.distributed import any_process, barrier, gather_rng_states
from packed_transformers.components.errors import RunError


class Stateful(Protocol):
    """A part of a run that a checkpoint keeps: its entries of training_state.pt (plain values
    and tensors: the file is read with weights_only=True), and put back from them."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, saved: dict) -> None: ...


@dataclass(frozen=True)
class RngStates:
    """Every process's RNG (Python's, numpy's, torch's, CUDA's) as a checkpoint's part: "rng",
    every rank's state (gathered: a collective every rank enters); put back, this rank's (rank
    0's for a rank the writer did not have: a run resumed on more processes)."""

    rank: int

    def state_dict(self) -> dict:
        return {"rng": gather_rng_states()}

    def load_state_dict(self, saved: dict) -> None:
        ckpt.set_rng_state(saved["rng"], self.rank)


def write_checkpoint(folder: Path, parts: tuple[Stateful, ...], keep: int, snapshot, rank: int) -> Path:
    """Every job's checkpoint of its run state's step (`parts[0]`, the RunState), a collective
    every process of the run calls: each part's entries (the RNG's gathered from every rank) and
    the engine's, step-N written by ckpt.save_checkpoint (rank 0, or every rank where the
    snapshot's `write_shards` writes a sharded run's DCP shards), then every rank learns whether
    rank 0's write failed and raises it alike (OSError or CheckpointError, one line), so none
    waits on a rank that left. snapshot: the engine's (engines.engine.Snapshot: model/'s
    writer, its entries of training_state.pt, the writer of dcp/). -> the checkpoint's folder."""
    write_model, write_shards, step = snapshot.model_writer(), snapshot.write_shards, parts[0].step
    state = {key: value for part in parts for key, value in part.state_dict().items()}
    state.update(snapshot.engine_state or {})
    final, failure = ckpt.step_folder(folder, step), None
    if rank == 0 or write_shards is not None:
        try:
            ckpt.save_checkpoint(folder, step, state, keep, write_model, write_shards, rank)
        except (OSError, ckpt.CheckpointError) as err:
            failure = err
    if any_process(failure is not None):
        raise failure or ckpt.CheckpointError(f"{final}: writing the checkpoint failed on rank 0")
    return final


def restore(folder: Path, load_into_run, parts: tuple[Stateful, ...], points=None) -> tuple[Path, dict]:
    """Every job's --resume: the checkpoint ckpt.resume_from picks (load_into_run(path, state),
    the engine's part, puts its weights, and where the job loads them there, its optimizer's
    state, into the run), then each part's state put back from it. `points`: resume_from's. ->
    (the checkpoint's folder, its training state as loaded). ckpt.CheckpointError where none is
    left, or for a state no part of this version reads (naming the file)."""
    path, saved = ckpt.resume_from(folder, load_into_run, points)
    try:
        for part in parts:
            part.load_state_dict(saved)
    except ckpt.CheckpointError as err:
        raise ckpt.CheckpointError(f"{path / 'training_state.pt'}: {err}") from None
    return path, saved


def load_model_weights(model, path: Path, replicas=None) -> None:
    """Every job's one weight loader at a resume: the checkpoint's model/model.safetensors
    into `model`, strictly (every name but a tied alias the folder stores once:
    components.replicas.load_weights); `replicas` sharded: each rank takes its shards
    (None: one process)."""
    from safetensors.torch import load_file

    from packed_transformers.components.replicas import ONE_PROCESS, load_weights

    load_weights(model, load_file(str(path / "model" / "model.safetensors")), replicas or ONE_PROCESS)


def resume_pretraining(
    output: Path, load_into_run, parts: tuple[Stateful, ...], rank: int, clean: bool = True
):
    """A pretraining run's --resume (BERT's on every engine, the decoder's): what a crash left
    half-written in OUTPUT/checkpoints removed by rank 0 (`clean`: not by --compile-only, which
    writes nothing), every rank waiting, then `restore` into `parts`. -> (path, training state);
    RunError "--resume: ..." where no checkpoint is left to resume."""
    folder = output / "checkpoints"
    if clean:  # the run folder's lock says no other run owns these temporaries
        remove_half_written(folder, rank)
    else:
        barrier()
    try:
        return restore(folder, load_into_run, parts)
    except ckpt.CheckpointError as err:
        raise RunError(f"--resume: {err}") from None


def remove_half_written(folder: Path, rank: int) -> None:
    """Rank 0 removes what a crash mid-write (kill -9) left of a checkpoint in `folder`; every
    rank waits for it."""
    if rank == 0:
        ckpt.remove_leftovers(folder)
    barrier()


def forget_lines_after(output: Path, step: int, rank: int) -> None:
    """Rank 0 of a resumed pretraining run, once the resume's checks have passed: the lines
    of OUTPUT/metrics.jsonl after `step` dropped (those steps are trained and logged again).
    RunError, one line, for a metrics.jsonl that cannot be read."""
    from packed_transformers.components.curves import MetricsFileError
    from packed_transformers.components.run_folder import forget_metrics_after

    if rank != 0:
        return
    try:
        forget_metrics_after(output / "metrics.jsonl", step)
    except MetricsFileError as err:
        raise RunError(f"--resume: {err}") from None
