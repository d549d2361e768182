"""Every job's checkpoint write (components.run_checkpoint.write_checkpoint) is one collective: each
rank's RNG state lands in the one training_state.pt, and a write that fails on rank 0 (a full
disk: OSError; a writer's own error: CheckpointError) is raised on every rank in one line, where
BERT's other ranks had gone on to a barrier rank 0 never reached."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from ..conftest import REPO
from ..processes import run_in_group

pytestmark = pytest.mark.slow

# Run by torchrun: two processes write step 7; with "fail", rank 0's model writer hits a full disk.
RANKS = """
import errno, json, sys
from pathlib import Path
import torch, torch.distributed as dist
from packed_transformers.components import checkpoint as ckpt, run_checkpoint
from packed_transformers.components.run_state import RunState
from packed_transformers.engines.engine import Snapshot
from types import SimpleNamespace

dist.init_process_group("gloo")
rank, out, fail = dist.get_rank(), Path(sys.argv[1]), sys.argv[2] == "fail"
torch.manual_seed(100 + rank)

def write_model(folder):
    if fail:
        raise OSError(errno.ENOSPC, "No space left on device", str(folder))
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w")
    (folder / "config.json").write_text("{}")

try:
    snapshot = Snapshot(SimpleNamespace(save_pretrained=write_model), {"scaler": None})
    parts = (RunState(step=7), run_checkpoint.RngStates(rank))
    path = run_checkpoint.write_checkpoint(out / "checkpoints", parts, 2, snapshot, rank)
    answer = {"path": str(path)}
except (OSError, ckpt.CheckpointError) as err:
    answer = {"error": type(err).__name__, "line": str(err)}
(out / f"rank{rank}.json").write_text(json.dumps(answer))
dist.destroy_process_group()
"""


def run_two(tmp_path, mode: str) -> list[dict]:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
               str(tmp_path), mode]  # fmt: skip
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = run_in_group(
        command, timeout=300, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_two_ranks_write_one_checkpoint_with_both_rng_states(tmp_path):
    from packed_transformers.components.checkpoint import check_checkpoint

    answers = run_two(tmp_path, "write")
    assert answers[0] == answers[1] == {"path": str(tmp_path / "checkpoints" / "step-00000007")}
    folder = tmp_path / "checkpoints" / "step-00000007"
    check_checkpoint(folder)  # its manifest matches its files
    state = torch.load(folder / "training_state.pt", weights_only=False)
    assert json.loads(state["state"])["step"] == 7 and state["scaler"] is None
    assert len(state["rng"]) == 2  # each rank resumes its own stream
    assert not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"])


def test_a_write_that_fails_on_rank_0_is_raised_on_every_rank_and_leaves_nothing(tmp_path):
    answers = run_two(tmp_path, "fail")
    assert answers[0]["error"] == "OSError" and "No space left on device" in answers[0]["line"]
    assert answers[1] == {"error": "CheckpointError",
                          "line": f"{tmp_path}/checkpoints/step-00000007: writing the checkpoint failed on rank 0"}  # fmt: skip
    assert not (tmp_path / "checkpoints" / "step-00000007").exists()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == []  # no temporary left either
