"""The IPU path under the SDK 3.4 stack's own versions (torch 2.0.1, transformers 4.38.2,
numpy 1.24: requirements-ipu.txt), on the PopTorch-rules double: opt-in, because that
stack is several GB (torch 2.0.1's wheel pulls CUDA 11.7 libraries).

    python -m venv /tmp/sdk && /tmp/sdk/bin/pip install -r requirements-ipu.txt (less horovod, mpi4py) pytest
    SDK_PYTHON=/tmp/sdk/bin/python make test-sdk-stack

The IPU engine runs in that interpreter (tests/ipu_instance.py) and must give the losses
and evaluations the CPU engine gives in this one. Python stays this machine's 3.11; the
3.8 grammar of the same path is tests/training/test_ipu_stack_python.py's job."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from packed_transformers.training.run import run_training

from ..conftest import REPO
from ..ipu_helpers import DOUBLES, _assert_same_run, _configs

SDK_PYTHON = os.environ.get("SDK_PYTHON")
pytestmark = pytest.mark.skipif(not SDK_PYTHON, reason="SDK_PYTHON (an SDK 3.4 stack interpreter) not given")


def test_the_sdk_stack_has_its_own_versions():
    done = subprocess.run(
        [SDK_PYTHON, "-c", "import torch, transformers; print(torch.__version__, transformers.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    torch_version, transformers_version = done.stdout.split()
    assert torch_version.startswith("2.0.1") and transformers_version == "4.38.2"


@pytest.mark.parametrize(
    "layers, ipu_keys, ga", [((1, 1), None, 5), ((0, 1, 1), {"embedding_serialization_factor": 4}, 7)]
)
def test_ipu_engine_on_the_sdk_stack_trains_like_the_cpu_engine(packed, tmp_path, layers, ipu_keys, ga):
    ipu, cpu = _configs(packed, 1, layers, ipu_keys, ga, checkpoint_every_steps=2)
    assert run_training(cpu, tmp_path / "cpu") == 0
    (tmp_path / "ipu.json").write_text(json.dumps(ipu))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(DOUBLES), str(REPO)]))
    done = subprocess.run(
        [SDK_PYTHON, "-m", "tests.ipu_instance", str(tmp_path / "ipu.json"), str(tmp_path / "ipu")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same_run(tmp_path / "cpu", tmp_path / "ipu")
