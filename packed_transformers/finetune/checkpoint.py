"""Fine-tuning checkpoints: every run's format and resume policy (components.checkpoint),
the latest only, its model/ in the run's own names (safetensors, loaded strictly) and the
progress (finetune.run_folder.RunState) as JSON in training_state.pt beside AdamW's, the
schedule's and every RNG's state. Written after every epoch's validation and when a signal
stops a run; an epoch's batch order is a pure function of seed and epoch, so the position in
it is a count of batches: a resumed run's weights equal the unstopped run's
(tests/finetune/test_finetune_resume.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from packed_transformers.components import checkpoint as ckpt

KEEP = 1  # a fine-tuning run keeps its latest checkpoint only (as many copies of the model as before)


def checkpoints_folder(output: Path) -> Path:
    return Path(output) / "checkpoints"


def save_checkpoint(output: Path, model, optimizer, progress: dict, replicas) -> Path:
    """Write the checkpoint of `progress` (RunState.progress()) and keep only it. -> its folder.
    Every process calls it: a sharded run's weights and optimizer state are gathered whole
    (the one format, whatever the number of ranks), every rank's RNG is kept, rank 0 writes.
    OSError (the disk's answer) or ckpt.CheckpointError (a writer's own error, one line)."""
    from packed_transformers.components.distributed import gather_rng_states
    from packed_transformers.components.replicas import gathered_optimizer_state, gathered_weights

    weights = gathered_weights(model, replicas)  # sharded: gathered whole; else None
    state = {
        "optimizer": gathered_optimizer_state(optimizer, replicas),
        "rng": gather_rng_states(),  # index = rank
        "state": json.dumps(progress),
    }
    final = ckpt.step_folder(checkpoints_folder(output), progress["steps"])
    failure = None
    if replicas.writes:
        try:
            ckpt.save_checkpoint(checkpoints_folder(output), progress["steps"], model, state, KEEP,
                                 ckpt.weights_writer(model, weights))  # fmt: skip
        except (OSError, ckpt.CheckpointError) as err:
            failure = err
    if replicas.agree(failure is not None):  # every rank raises where rank 0's write failed
        raise failure or ckpt.CheckpointError(f"{final}: writing the checkpoint failed on rank 0")
    return final


def has_checkpoint(output: Path) -> bool:
    """Whether OUTPUT holds any checkpoint folder (intact or not)."""
    return bool(ckpt.list_checkpoints(checkpoints_folder(output)))


def read_progress(output: Path) -> dict | None:
    """The newest intact checkpoint's progress; None without one. ckpt.CheckpointError where
    there are checkpoints and none intact, or its state is not plain values."""
    if not has_checkpoint(output):
        return None
    newest = ckpt.latest_valid_checkpoint(checkpoints_folder(output))
    if newest is None:
        raise ckpt.CheckpointError(f"{checkpoints_folder(output)} holds no intact checkpoint")
    return json.loads(ckpt.load_training_state(newest)["state"])


def load_checkpoint(output: Path, model, optimizer, replicas) -> tuple[Path, dict]:
    """Restore weights, optimizer and RNG (this rank's; rank 0's for a rank the writer did not
    have) from the checkpoint resume_from picks, whatever number of ranks wrote it. The
    learning rate follows from the progress' step count (an older checkpoint's LambdaLR state
    is read by nobody). -> (its folder, its progress). ckpt.CheckpointError when none is left."""
    from safetensors.torch import load_file

    from packed_transformers.components.replicas import load_optimizer_state, load_weights

    def load_into_run(path: Path, state: dict) -> None:
        load_weights(model, load_file(str(path / "model" / "model.safetensors")), replicas)  # strict
        load_optimizer_state(optimizer, state["optimizer"], replicas)

    path, state = ckpt.resume_from(checkpoints_folder(output), load_into_run)
    rng = state["rng"]
    ckpt.set_rng_state(rng[replicas.rank] if replicas.rank < len(rng) else rng[0])
    return path, json.loads(state["state"])
