"""The IPU backend's parts that run without poptorch: the plan, the compiled step's math
(against the torch path), the host-side inputs, and the missing-poptorch exit."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time

import pytest
import torch

from packed_transformers.components.data import PackedShards, pad_micro_batch
from packed_transformers.components.observe import SUM_KEYS, MetricSums
from packed_transformers.engines.engine import PER_TOKEN
from packed_transformers.engines.ipu_plan import IpuPlanError, make_plan
from packed_transformers.engines.ipu_step import (
    GRAPH_FIELDS,
    OneHotGather,
    PretrainingStep,
    SerializedProjection,
    adapt_for_ipu,
    split_matmul,
    step_inputs,
)
from packed_transformers.engines.torch_engine import StepSettings, TorchStep
from packed_transformers.model import PackedBertForPreTraining, bert_config
from packed_transformers.optim import Lamb, weight_decay_groups
from packed_transformers.training.build import open_packed
from packed_transformers.training.config import load_config, validate

from ..conftest import REPO
from ..training_helpers import VOCAB, base_config


def pod16(**changes) -> dict:
    config = load_config(REPO / "configs" / "mlperf_phase2_packed_ipu_pod16.yaml")
    for path, value in changes.items():
        section, key = path.split("__")
        config[section][key] = value
    return config


# --------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------
def test_pod16_plan_places_and_counts_like_graphcores_bert():
    plan = make_plan(pod16(), packing_factor=2.0)
    assert (plan.replicas, plan.ipus_per_replica, plan.total_ipus) == (4, 4, 16)
    assert plan.gradient_accumulation == 192 and plan.device_iterations == 1
    assert plan.packs_per_step == 2 * 192 * 4 == 1536
    assert plan.sequences_per_step == pytest.approx(1536 * 2.0)
    assert plan.micro_batches_per_call == 192 * 4  # one instance drives all 4 replicas
    by_ipu = {i: [p.module for p in plan.placements if p.ipu == i] for i in range(4)}
    assert by_ipu[0][0] == "model.bert.embeddings" and by_ipu[0][-1] == "heads"  # tied weights on IPU 0
    layers = [sum(".layer." in m for m in by_ipu[i]) for i in range(4)]
    assert layers == [3, 7, 7, 7]
    # Encoder layers appear in order, each once.
    order = [int(p.module.rsplit(".", 1)[1]) for p in plan.placements if ".layer." in p.module]
    assert order == list(range(24))
    assert plan.recompute_layers == tuple(range(23))
    assert plan.betas == (0.62, 0.996) and plan.half and plan.loss_scaling == 512.0
    # Graphcore's BERT-Large S=512 memory settings (configs_pretraining.yml pretrain_large_512)
    assert plan.available_memory_proportion == {"IPU0": 0.10, "IPU1": 0.15, "IPU2": 0.15, "IPU3": 0.15}
    assert plan.embedding_serialization_factor == 2 and plan.optimizer_state_offchip
    assert plan.onehot_gather and plan.popart_performance_options and not plan.synthetic_data
    assert plan.replicated_tensor_sharding and not plan.use_ipu_model


def test_an_empty_ipu_0_holds_the_embeddings_and_the_heads():
    """Graphcore's BERT-Base layout [0, 4, 4, 4]: IPU 0 runs the embeddings and the heads only.
    Forward stages: emb (IPU0) -> IPU1 -> IPU2 -> IPU3 -> heads (IPU0) = 5; training 9."""
    plan = make_plan(pod16(execution__layers_per_stage=[0, 8, 8, 8]), 2.0)
    by_ipu = {i: [p.module for p in plan.placements if p.ipu == i] for i in range(4)}
    assert by_ipu[0] == ["model.bert.embeddings", "heads"]
    assert [len(by_ipu[i]) for i in (1, 2, 3)] == [8, 8, 8]
    assert plan.forward_stages == 5


def test_pod64_plan_splits_replicas_over_instances():
    config = load_config(REPO / "configs" / "mlperf_phase2_packed_ipu_pod64.yaml")
    plan = make_plan(config, packing_factor=1.9, instances=4)
    assert plan.total_ipus == 64 and plan.local_replicas == 4
    assert plan.packs_per_step == 1536  # the POD16 global batch
    assert plan.micro_batches_per_call == 48 * 4


def test_packing_adjustment_and_device_iterations_enter_the_arithmetic():
    config = pod16(
        optim__packing_adjustment="same_packs_per_step", optim__betas=[0.9, 0.999], ipu__device_iterations=4
    )
    plan = make_plan(config, packing_factor=2.0)
    assert plan.betas == pytest.approx((0.81, 0.999**2))
    assert plan.packs_per_call == 1536 * 4 and plan.micro_batches_per_call == 192 * 4 * 4
    halved = make_plan(pod16(optim__packing_adjustment="same_sequences_per_step"), packing_factor=2.0)
    assert halved.gradient_accumulation == 96


def test_ipu_model_config_selects_the_simulator():
    plan = make_plan(load_config(REPO / "configs" / "ipu_model_tiny.yaml"), packing_factor=1.75)
    assert plan.use_ipu_model and plan.layers_per_stage == (1, 1) and plan.total_ipus == 4


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"execution__layers_per_stage": [3, 7, 7, 6]}, r"sums to 23, but the model has 24"),
        ({"execution__layers_per_stage": [4, 4, 4, 4, 4, 4]}, r"6 stages but ipu.ipus_per_replica is 4"),
        ({"execution__layers_per_stage": [8, 0, 8, 8]}, r"a stage without layers after IPU 0"),
        ({"execution__layers_per_stage": [0, 0, 12, 12]}, r"a stage without layers after IPU 0"),
        (
            {"ipu__embedding_serialization_factor": 7, "model__init_checkpoint": None},
            r"7 does not divide the vocabulary \(30522",
        ),
        ({"execution__layers_per_stage": None}, r"must list the encoder layers.*\[6, 6, 6, 6\]"),
        (
            {"optim__gradient_accumulation": 6},
            r"gradient accumulation 6 .* 9 training pipeline stages .* 5 forward stages",
        ),
        ({"model__attention_backend": "sdpa"}, r"attention_backend 'sdpa'.*dense"),
        ({"model__mlm_loss_mode": "per_sequence"}, r"per_sequence"),
        ({"optim__max_grad_norm": 1.0}, r"max_grad_norm.*no global gradient-norm clipping"),
        ({"training__precision": "bf16"}, r"ipu.half"),
        ({"ipu__replicas": 6}, None),  # 6 replicas over 4 instances: checked below
        ({"ipu__available_memory_proportion": [0.2, 0.2]}, r"one per IPU"),
        ({"ipu__available_memory_proportion": [1.5]}, r"\(0, 1\]"),
        ({"execution__device": "cpu"}, r"needs ipu or ipu-model"),
    ],
)
def test_invalid_plans_are_refused_with_the_key(changes, message):
    if message is None:
        with pytest.raises(IpuPlanError, match=r"ipu.replicas 6 is not a multiple of the 4 poprun"):
            make_plan(pod16(**changes), 2.0, instances=4)
        return
    with pytest.raises(IpuPlanError, match=message):
        make_plan(pod16(**changes), 2.0)


def test_one_memory_proportion_applies_to_every_ipu():
    plan = make_plan(pod16(ipu__available_memory_proportion=[0.3]), 2.0)
    assert plan.available_memory_proportion == {f"IPU{i}": 0.3 for i in range(4)}


# --------------------------------------------------------------------------------------
# Missing poptorch: exit 2, one clear line, before any data is read
# --------------------------------------------------------------------------------------
def _run_tiny_ipu_config(tmp_path, env=None):
    """run_pretraining.py on the IPUModel config with data that does not exist."""
    return subprocess.run(
        [sys.executable, "run_pretraining.py", "--config", "configs/ipu_model_tiny.yaml"]
        + ["--output-dir", str(tmp_path / "out"), "--set", "data.train_dir=/nonexistent/packed"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.slow
def test_ipu_model_config_exits_2_quickly_without_poptorch(tmp_path):
    try:
        import poptorch  # noqa: F401

        pytest.skip("poptorch is installed here: the missing-poptorch path cannot be shown")
    except ImportError:
        pass
    started = time.perf_counter()
    done = _run_tiny_ipu_config(tmp_path)
    assert done.returncode == 2
    assert "needs poptorch, which does not import here (No module named 'poptorch')" in done.stderr
    assert "Poplar SDK 3.4" in done.stderr and "torch 2.0.1" in done.stderr and "Traceback" not in done.stderr
    assert "/nonexistent" not in done.stderr  # refused before the data was looked at
    assert not (tmp_path / "out").exists()
    assert time.perf_counter() - started < 60


@pytest.mark.slow
def test_poptorch_version_assertion_is_one_line_exit_2(tmp_path):
    """poptorch 3.4's python/__init__.py asserts the torch version at import (AssertionError,
    not ImportError): still exit 2 and one line naming the versions."""
    fake = tmp_path / "site" / "poptorch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        'import torch\nassert torch.__version__ == "2.0.1", "PopTorch 3.4 needs torch 2.0.1, found " + torch.__version__\n'
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}"}
    done = _run_tiny_ipu_config(tmp_path, env)
    assert done.returncode == 2, done.stderr
    assert "PopTorch 3.4 needs torch 2.0.1, found" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------
# The compiled step's math, run on CPU, against the torch path
# --------------------------------------------------------------------------------------
def _micro_batches(packed, count, rows=4):
    config = validate(base_config(packed))
    shards = PackedShards(open_packed(packed / "train", config, "train"))
    return [shards[list(range(i * rows, (i + 1) * rows))] for i in range(count)]


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    config = bert_config(
        "bert-tiny", vocab_size=VOCAB, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    return PackedBertForPreTraining(config)


def _lamb(model):
    return Lamb(weight_decay_groups(model.named_parameters(), 0.01), lr=0.01, betas=(0.9, 0.999))


def test_pretraining_step_trains_exactly_like_the_torch_step(packed):
    """Two optimizer steps of 4 micro-batches each (GA 2 x 2 replicas on an IPU): the
    graph's scaled loss, summed as PopTorch's Sum reduction does, gives the torch step's
    weights and metric sums."""
    micro = _micro_batches(packed, 8)
    torch_model = _tiny_model()
    ipu_model = copy.deepcopy(torch_model)
    torch_opt, ipu_opt = _lamb(torch_model), _lamb(ipu_model)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    torch_step = TorchStep(
        torch_model, torch_opt, torch_model, StepSettings(torch.device("cpu")), scaler=scaler
    )
    step = PretrainingStep(ipu_model)
    torch_sums, ipu_sums = MetricSums(), MetricSums()
    for s in range(2):
        group = micro[s * 4 : (s + 1) * 4]
        result = torch_step.step(group, PER_TOKEN, 0.01)
        counts = result.units
        for vector in result.kept:
            torch_sums.add_vector(vector)
        inputs = step_inputs(group, 1, [counts])
        rows = group[0]["input_ids"].shape[0]
        for i in range(4):  # the micro-batches PopTorch would feed one by one
            piece = {k: v[i * rows : (i + 1) * rows] for k, v in inputs.items()}
            loss, sums = step(**piece)
            loss.backward()
            ipu_sums.add_vector(sums.reshape(-1, len(SUM_KEYS)).sum(0))
        for g in ipu_opt.param_groups:
            g["lr"] = 0.01
        ipu_opt.step()
        ipu_opt.zero_grad(set_to_none=True)
    a, b = torch_model.state_dict(), ipu_model.state_dict()
    assert max((a[n] - b[n]).abs().max().item() for n in a) <= 1e-6
    ta, tb = torch_sums.reduce(), ipu_sums.reduce()
    for key in SUM_KEYS:
        assert ta[key] == pytest.approx(tb[key], rel=1e-6), key


def test_step_inputs_scale_each_device_iteration_by_its_own_counts(packed):
    micro = _micro_batches(packed, 4, rows=2)
    counts = [torch.tensor([40.0, 8.0]), torch.tensor([20.0, 5.0])]
    inputs = step_inputs(micro, 2, counts)
    assert set(inputs) == set(GRAPH_FIELDS) | {"mlm_scale", "nsp_scale"}
    assert inputs["input_ids"].shape[0] == 8
    assert torch.equal(inputs["input_ids"][2:4], micro[1]["input_ids"])
    assert inputs["mlm_scale"].tolist() == pytest.approx([1 / 40] * 4 + [1 / 20] * 4)
    assert inputs["nsp_scale"].tolist() == pytest.approx([1 / 8] * 4 + [1 / 5] * 4)
    with pytest.raises(ValueError, match="do not split into 3 steps"):
        step_inputs(micro, 3, counts + [counts[0]])


def test_padding_packs_add_nothing_to_eval_sums(packed):
    model = _tiny_model().eval()
    step = PretrainingStep(model)
    batch = _micro_batches(packed, 1, rows=3)[0]
    zero = [torch.zeros(2)]
    with torch.no_grad():
        _, plain = step(**step_inputs([batch], 1, zero))
        _, padded = step(**step_inputs([pad_micro_batch(batch, 5)], 1, zero))
    assert pad_micro_batch(batch, 5)["input_ids"].shape[0] == 5
    assert torch.allclose(plain, padded, rtol=1e-6, atol=1e-6)
    assert not torch.isnan(padded).any()


def test_ipu_kernels_compute_what_the_model_computes(packed):
    """adapt_for_ipu (one-hot gathers, the decoder split over the vocabulary) leaves the
    state dict, the outputs and the gradients of the model as they were."""
    batch = _micro_batches(packed, 1)[0]
    plain = _tiny_model()
    adapted = adapt_for_ipu(copy.deepcopy(plain), serialization_factor=4, onehot_gather=True)
    assert isinstance(adapted.mlm_gather, OneHotGather) and isinstance(
        adapted.bert.pooler.gather, OneHotGather
    )
    assert isinstance(adapted.cls.predictions.project, SerializedProjection)
    assert list(adapted.state_dict()) == list(plain.state_dict())
    assert (
        adapted.cls.predictions.decoder.weight is adapted.bert.embeddings.word_embeddings.weight
    )  # still tied
    a, b = plain(**batch), adapted(**batch)
    for key in ("mlm_logits", "nsp_logits", "loss", "mlm_correct"):
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-5)
    a["loss"].backward()
    b["loss"].backward()
    for (name, p), q in zip(plain.named_parameters(), adapted.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_split_matmul_is_the_matmul():
    lhs, rhs = torch.randn(3, 5, 8, dtype=torch.float64), torch.randn(8, 12, dtype=torch.float64)
    for factor in (1, 2, 3, 4, 6, 12):
        torch.testing.assert_close(split_matmul(lhs, rhs, factor), lhs @ rhs)


@pytest.mark.slow
def test_an_ipu_config_the_ipu_cannot_compile_exits_2_before_any_data_is_read(tmp_path):
    """The engine's config check runs before the data is opened: a varlen-attention IPU
    config over a training folder that does not exist is refused for its attention backend
    (exit 2, one line naming the key), within seconds, with or without poptorch."""
    started = time.perf_counter()
    result = subprocess.run(
        [
            sys.executable,
            "run_pretraining.py",
            "--config",
            "configs/ipu_model_tiny.yaml",
            "--set",
            "model.attention_backend=varlen",
            "--set",
            f"data.train_dir={tmp_path / 'absent'}",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 2, result.stderr
    assert "model.attention_backend 'varlen'" in result.stderr
    assert "absent" not in result.stderr
    assert not (tmp_path / "out").exists()
    assert time.perf_counter() - started < 30


def test_the_graphcore_v2_config_has_graphcores_bert_large_512_layout():
    """Issue 33, N6: configs/mlperf_graphcore_pod16_v2.0.yaml places and sizes BERT-Large at
    S=512 as graphcore/examples' pretrain_large_512 does (it had 3 packs per micro-batch,
    S=128's memory proportions and LAMB state on chip: out of memory on IPUs 1-3)."""
    config = load_config(REPO / "configs" / "mlperf_graphcore_pod16_v2.0.yaml")
    ipu = config["ipu"]
    assert config["data"]["micro_batch_packs"] == 2
    assert config["execution"]["layers_per_stage"] == [3, 7, 7, 7]
    assert ipu["available_memory_proportion"] == [0.10, 0.15, 0.15, 0.15]
    assert ipu["optimizer_state_offchip"] and ipu["embedding_serialization_factor"] == 2
    assert ipu["recompute_checkpoints"] and ipu["replicated_tensor_sharding"]
    plan = make_plan(config, packing_factor=2.0)
    assert plan.packs_per_step == 1536  # the v2.0 submission's global batch, kept


def test_training_options_reduce_by_running_mean_with_the_scales_times_n(monkeypatch):
    """Issue 33, N5: Mean reduction, Running strategy (Graphcore's), and the host's loss
    scales multiplied by GA x replicas so the step's gradient is the torch path's."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "doubles"))
    for name in [m for m in sys.modules if m == "poptorch" or m.startswith("poptorch.")]:
        monkeypatch.delitem(sys.modules, name)
    import poptorch

    from packed_transformers.engines.ipu import build_options

    plan = make_plan(pod16(), packing_factor=2.0)
    opts = build_options(poptorch, plan, training=True)
    assert opts.Training.reduction == poptorch.ReductionType.Mean
    assert opts.Training.mean_strategy == poptorch.MeanReductionStrategy.Running
    assert plan.mean_reduction_factor == plan.gradient_accumulation * plan.replicas
    counts = [torch.tensor([10.0, 4.0])]
    batch = {name: torch.zeros(1, 8, dtype=torch.long) for name in GRAPH_FIELDS}
    scaled = step_inputs([batch], 1, counts, plan.mean_reduction_factor)
    plain = step_inputs([batch], 1, counts)
    assert torch.allclose(scaled["mlm_scale"], plain["mlm_scale"] * plan.mean_reduction_factor)
    for name in [m for m in sys.modules if m == "poptorch" or m.startswith("poptorch.")]:
        del sys.modules[name]
