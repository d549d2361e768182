"""A pretraining run's time limits are every process's verdict (components.trainer.PretrainingTrainer):
a process whose clock passed training.max_seconds (or max_train_seconds) stops every process at
that step. Before, BERT's run asked each process's own clock: under DDP one process left the
loop while another began a step, and the two waited in different collectives."""

from __future__ import annotations

import json
import os
import sys

import pytest

from ..conftest import REPO
from ..processes import run_in_group

pytestmark = pytest.mark.slow

# Run by torchrun: rank 0's clocks have passed both limits, rank 1's have not.
RANKS = """
import json, sys, time
import torch.distributed as dist
from packed_transformers.components.trainer import PretrainingTrainer
from packed_transformers.components.run_state import RunState

dist.init_process_group("gloo")
rank = dist.get_rank()
ahead = 100.0 if rank == 0 else 0.0

class Clocked(PretrainingTrainer):
    state = RunState(step=3)
    def __init__(self):  # the clocks alone: no run set up
        pass
    def train_seconds(self):
        return ahead

verdicts = {}
for name in ("max_seconds", "max_train_seconds"):
    job = Clocked()
    job.config = {"training": {"max_steps": 10, name: 50.0}}
    job.started = time.perf_counter() - ahead
    verdicts[name] = job.limit_reached()
open(f"{sys.argv[1]}/rank{rank}.json", "w").write(json.dumps(verdicts))  # ranks' stdout lines may interleave
dist.destroy_process_group()
"""


def test_a_time_limit_one_process_reached_stops_every_process(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        str(tmp_path),
    ]
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = run_in_group(
        command, timeout=300, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    verdicts = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for verdict in verdicts:  # rank 1's own clocks are at 0 s of 50: it stops because rank 0's passed
        assert verdict["max_seconds"] == "max_seconds"
        assert verdict["max_train_seconds"] == "max_train_seconds"


def test_one_process_alone_reads_its_own_clock():
    import time

    from packed_transformers.components.run_state import RunState
    from packed_transformers.components.trainer import PretrainingTrainer

    class Clocked(PretrainingTrainer):
        def __init__(self):  # the clocks alone: no run set up
            pass

    job = Clocked()
    job.state, job.config = RunState(step=3), {"training": {"max_steps": 10, "max_seconds": 50.0}}
    job.started = time.perf_counter()
    assert job.limit_reached() is None
    job.started -= 60.0
    assert job.limit_reached() == "max_seconds"
    job.state.step = 10
    assert job.limit_reached() == "max_steps"  # the step limit is named first
