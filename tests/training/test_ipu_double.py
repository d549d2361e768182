"""IpuEngine through the real run loop on CPU, against the PopTorch-rules double in
tests/doubles/poptorch (never product code; its docstring lists each rule and its source,
and what a double cannot show), with doubles of popart's enums, PopDist and Horovod for
poprun's instances. Evaluation in the loop and at the end, checkpoints, --resume, 1 and 2
replicas, 2 poprun instances, a 2-IPU pipeline and an empty IPU 0, the serialized MLM
decoder, --compile-only, synthetic data. Losses must equal the torch CPU engine's."""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from packed_transformers.training.config import validate
from packed_transformers.training.run import run_training

from ..conftest import REPO
from ..ipu_helpers import (  # noqa: F401
    DOUBLES,
    _assert_same_run,
    _configs,
    _rows,  # noqa: F401
)

# End to end (whole runs, subprocesses): `pytest -m "not slow"` leaves them out.
pytestmark = pytest.mark.slow

DOUBLE_MODULES = ("poptorch", "popart", "popdist", "horovod")


def _double_modules():
    return [m for m in sys.modules if m.split(".")[0] in DOUBLE_MODULES]


@pytest.fixture
def poptorch_double(monkeypatch):
    for name in _double_modules():
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(DOUBLES))
    import poptorch

    assert "doubles" in poptorch.__file__, "the double, never a real poptorch, in this test"
    poptorch._ATTACHED.clear()
    from packed_transformers.engines.ipu import IpuEngine

    yield IpuEngine
    # Leave no double behind: other tests look for a real poptorch.
    for name in _double_modules():
        del sys.modules[name]


@pytest.mark.parametrize(
    "replicas, layers, ipu_keys, ga",
    [
        (1, (1, 1), None, 5),
        (2, (1, 1), None, 5),
        # Index gathers and an unsplit decoder: the one-hot and serialized kernels are options.
        (1, (1, 1), {"onehot_gather": False, "popart_performance_options": False}, 5),
        # Graphcore BERT-Large's decoder split, an empty IPU 0 (4 forward stages: GA >= 7).
        (1, (0, 1, 1), {"embedding_serialization_factor": 4}, 7),
    ],
    ids=["1-replica", "2-replicas", "plain-kernels", "empty-ipu0-serialized"],
)
def test_ipu_engine_trains_and_evaluates_like_the_cpu_engine(
    packed, tmp_path, poptorch_double, replicas, layers, ipu_keys, ga
):
    ipu, cpu = _configs(packed, replicas, layers, ipu_keys, ga)
    assert run_training(cpu, tmp_path / "cpu") == 0
    assert run_training(ipu, tmp_path / "ipu", engine_class=poptorch_double) == 0
    _assert_same_run(tmp_path / "cpu", tmp_path / "ipu")


def test_resume_on_the_ipu_engine_is_exact(packed, tmp_path, poptorch_double):
    ipu, _ = _configs(packed, 1, checkpoint_every_steps=2)
    assert run_training(ipu, tmp_path / "straight", engine_class=poptorch_double) == 0
    first = copy.deepcopy(ipu)
    first["training"]["max_steps"] = 2
    assert run_training(first, tmp_path / "split", engine_class=poptorch_double) == 0
    assert run_training(ipu, tmp_path / "split", resume=True, engine_class=poptorch_double) == 0
    train = lambda rows: [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]  # noqa: E731
    assert train(_rows(tmp_path / "split")) == train(_rows(tmp_path / "straight"))


def test_a_sharded_runs_dcp_checkpoint_is_refused_in_one_line(poptorch_double):
    """The IPU engine keeps LAMB's state whole: a checkpoint whose optimizer is a sharded torch
    run's dcp/ shards (no "optimizer" in training_state.pt) is refused before anything is
    loaded, naming it (the pipeline engine's refusal: tests/training/test_bert_fsdp.py, end to end)."""
    from packed_transformers.components.errors import RunError

    engine = object.__new__(poptorch_double)  # the refusal reads nothing of an attached engine
    with pytest.raises(RunError, match=r"^--resume: run/checkpoints/step-00000002 keeps its optimizer as a sharded "
                                       r"run's dcp/ shards, which the IPU engine does not read"):  # fmt: skip
        engine.load_state({"state": "{}", "rng": []}, Path("run/checkpoints/step-00000002"))


def test_the_double_refuses_what_poptorch_refuses(poptorch_double):
    import poptorch
    import torch

    with pytest.raises(TypeError):
        poptorch.optim.LAMB([torch.nn.Parameter(torch.zeros(2))], lr=0.1, max_grad_norm=1.0)  # R9
    model = torch.nn.Linear(2, 2)
    opts = poptorch.Options()
    opts.deviceIterations(2)
    executor = (
        poptorch.inferenceModel(lambda **k: None, opts) if False else poptorch.inferenceModel(model, opts)
    )
    with pytest.raises(RuntimeError, match="Model has not been compiled"):
        executor.detachFromDevice()
    with pytest.raises(RuntimeError, match="not been compiled"):
        _ = executor.rng_state  # R7


def test_the_double_refuses_offline_targets_on_the_ipu_model_and_unknown_popart_options(poptorch_double):
    import poptorch
    import torch

    model = torch.nn.Linear(2, 2)
    opts = poptorch.Options()
    opts.useIpuModel(True)
    opts.useOfflineIpuTarget(2)
    with pytest.raises(RuntimeError, match="offline IPU target cannot be used if the IPU model"):
        poptorch.inferenceModel(model, opts).compile(input=torch.zeros(1, 2))  # R11
    opts = poptorch.Options()
    opts._Popart.set("noSuchSessionOption", True)
    with pytest.raises(RuntimeError, match="Unknown PopART option"):
        poptorch.inferenceModel(model, opts).compile(input=torch.zeros(1, 2))  # R13
    with pytest.raises(RuntimeError, match="does not divide"):
        poptorch.serializedMatMul(
            torch.zeros(2, 3), torch.zeros(3, 5), poptorch.MatMulSerializationMode.OutputChannels, 2
        )


@pytest.mark.parametrize("device", ["ipu", "ipu-model"])
def test_compile_only_compiles_both_graphs_and_writes_nothing(
    packed, tmp_path, poptorch_double, device, caplog
):
    ipu, _ = _configs(packed, 2)
    ipu["execution"]["device"] = device
    ipu["execution"]["compile_only"] = True
    ipu = validate(ipu)
    caplog.set_level("INFO")
    assert run_training(ipu, tmp_path / "out", engine_class=poptorch_double) == 0
    assert not (tmp_path / "out").exists()  # a later real run there finds no "other run"
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "IPU training graph compiled" in messages and "IPU inference graph compiled" in messages
    import poptorch

    assert not poptorch._ATTACHED  # nothing left holding the IPUs


def test_synthetic_data_trains_on_the_ipu_engine_without_reading_data(packed, tmp_path, poptorch_double):
    ipu, _ = _configs(packed, 1)
    ipu["data"].update(
        synthetic=True,
        train_dir="/nonexistent",
        eval_dir=None,
        max_sequences_per_pack=3,
        synthetic_packing_factor=2.5,
    )
    ipu["logging"]["mlperf"] = False
    assert run_training(validate(ipu), tmp_path / "out", engine_class=poptorch_double) == 0
    rows = [r for r in _rows(tmp_path / "out") if r["kind"] == "train"]
    assert len(rows) == 4 and all(r["loss"] > 0 for r in rows)
    # 4 packs x GA 5 per step at a packing factor of 2.5 on average
    assert 30 <= rows[0]["samples"] <= 70


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _poprun(config: dict, output: Path, workdir: Path, resume: bool = False) -> None:
    """Two poprun instances of `config` (one replica each) as two processes."""
    config_file = workdir / f"{output.name}.json"
    config_file.write_text(json.dumps(config))
    port = str(_free_port())
    processes = []
    for instance in range(2):
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(DOUBLES), str(REPO)]),
            DOUBLE_POPDIST_INSTANCES="2",
            DOUBLE_POPDIST_INSTANCE=str(instance),
            DOUBLE_POPDIST_REPLICAS="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            DOUBLE_HOROVOD_LATE_SECONDS="0" if instance == 0 else "4",
        )
        command = [sys.executable, "-m", "tests.ipu_instance", str(config_file), str(output)]
        processes.append(
            subprocess.Popen(
                command + (["--resume"] if resume else []),
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=600)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], [o[-3000:] for o in outputs]


def test_two_poprun_instances_train_and_resume_like_one_process(packed, tmp_path):
    """Two host processes, one replica each, joined by the Horovod double, stopped after 2
    steps and resumed on both instances: the same 4 steps as the CPU engine with GA x 2 in one
    uninterrupted process, evaluation synchronised (the last one's figures equal), only
    instance 0 writes."""
    ipu, cpu = _configs(packed, replicas=2, checkpoint_every_steps=2)
    assert run_training(cpu, tmp_path / "cpu") == 0
    first = copy.deepcopy(ipu)
    first["training"]["max_steps"] = 2
    _poprun(first, tmp_path / "split", tmp_path)
    _poprun(ipu, tmp_path / "split", tmp_path, resume=True)
    train = lambda rows: [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]  # noqa: E731
    split, one = train(_rows(tmp_path / "split")), train(_rows(tmp_path / "cpu"))
    assert [step for step, _ in split] == [step for step, _ in one] == [1, 2, 3, 4]
    assert [loss for _, loss in split] == pytest.approx([loss for _, loss in one], abs=1e-5)
    evals = [[r for r in _rows(tmp_path / run) if r["kind"] == "eval"] for run in ("cpu", "split")]
    assert evals[0] and evals[1][-1]["mlm_accuracy"] == pytest.approx(evals[0][-1]["mlm_accuracy"], abs=1e-5)
    assert evals[1][-1]["masked_tokens"] == evals[0][-1]["masked_tokens"]
    # N8: the checkpoint holds each instance's own IPU RNG state (not instance 0's for all)
    import torch

    checkpoint = sorted((tmp_path / "split" / "checkpoints").glob("step-*"))[0]
    states = torch.load(checkpoint / "training_state.pt", weights_only=True)["ipu_rng_states"]
    assert [state[-1] for state in states] == [0, 1]


def test_the_double_refuses_ops_poptorch_has_no_handler_for_and_the_dense_mask_uses_none(poptorch_double):
    """R16: torch.eye stops the compile, as PopTorch 3.4 does; the dense mask (the IPU's
    form) is built from supported ops only (it used torch.eye before issue 33's N2)."""
    import poptorch
    import torch

    from packed_transformers.model.attention import additive_mask

    class WithEye(torch.nn.Module):
        def forward(self, input):
            return input @ torch.eye(2)

    with pytest.raises(RuntimeError, match=r"Unsupported ops found in compiled model: \[aten::eye\]"):
        poptorch.inferenceModel(WithEye(), poptorch.Options()).compile(input=torch.zeros(1, 2))

    class Mask(torch.nn.Module):
        def forward(self, sequence_ids):
            return additive_mask(sequence_ids, torch.float16)

    ids = torch.tensor([[1, 1, 2, 2, 2, 0, 0]])
    ops = poptorch._aten_ops(Mask(), {"sequence_ids": ids})
    assert ops and not ops & poptorch.UNSUPPORTED_ATEN, sorted(ops)
    mask = additive_mask(ids, torch.float32)[0, 0]
    assert (mask.diagonal() == 0).all()  # padding attends to itself: finite softmax
    assert mask[0, 2] < 0 and mask[2, 4] == 0 and mask[5, 6] < 0


def test_popart_session_options_need_no_popart_module(packed, tmp_path, poptorch_double, monkeypatch):
    """N3: the PopART options are set from integer values (PopTorch's options.py takes the
    integers), so a Poplar-only environment without `popart` trains; the values are PopART's."""
    import popart

    from packed_transformers.engines import ipu as ipu_module

    assert (
        ipu_module.OVERLAP_MEMORY_OPTIMIZED == popart.AccumulateOuterFragmentSchedule.OverlapMemoryOptimized
    )
    assert ipu_module.JUST_IN_TIME == popart.SubgraphCopyingStrategy.JustInTime
    monkeypatch.setitem(sys.modules, "popart", None)  # `import popart` raises ImportError
    ipu, _ = _configs(packed, 1, (1, 1), {"popart_performance_options": True}, max_steps=2)
    assert run_training(ipu, tmp_path / "ipu", engine_class=poptorch_double) == 0


def test_fp16_mlm_loss_makes_no_fp32_copy_of_the_logits():
    """N7: with fp16 logits (IPU half) the MLM cross-entropy runs on them; no float32
    tensor of the logits' size is made (Graphcore's BERT: fp16 logits, the scalar cast)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from packed_transformers.model.heads import mlm_metrics

    b, m, v = 2, 4, 50
    logits = torch.randn(b, m, v).half()
    ids = torch.randint(0, v, (b, m))
    weights = torch.tensor([[1, 1, 2, 0], [1, 2, 2, 2]])
    made = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else [out]:
                if isinstance(t, torch.Tensor):
                    made.append((t.dtype, t.numel()))
            return out

    with Watch():
        out = mlm_metrics(logits, ids, weights, "per_token")
    assert (torch.float32, b * m * v) not in made
    reference = torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), ids.flatten(), reduction="none"
    )
    expected = (reference.view(b, m) * (weights > 0)).sum()
    assert torch.allclose(out["mlm_loss_sum"].float(), expected, rtol=2e-3)
