"""bench/bench_gpu.py's CPU-side logic: the batches it feeds and the FLOP count behind its
model-FLOPs-utilisation column (the GPU run itself needs a GPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ..conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from bench_gpu import K, M, S, make_batches, model_flops  # noqa: E402

from packed_transformers.model import bert_config  # noqa: E402


def test_flop_count_by_hand():
    """Two sequences (3 and 2 tokens, one masked token) through a 1-layer model."""
    config = bert_config("bert-tiny", num_hidden_layers=1, vocab_size=10)  # H=64, I=128
    ids = torch.tensor([[1, 1, 1, 2, 2, 0]])
    batch = {
        "sequence_ids": ids,
        "next_sentence_weights": torch.tensor([[1, 1, 0]]),
        "masked_lm_weights": torch.tensor([[1, 0]]),
    }
    h, i, v = 64, 128, 10
    forward = (
        2 * (4 * h * h + 2 * h * i) * 5 + 4 * h * (9 + 4) + 2 * (h * h + h * v) * 1 + 2 * (h * h + 2 * h) * 2
    )
    assert model_flops(batch, config) == 3 * forward


def test_batches_are_packed_and_padded_rows_of_the_same_shape():
    packed = make_batches(4, 2, True, 0, 30522)
    padded = make_batches(4, 2, False, 1, 30522)
    for batch in packed + padded:
        assert batch["input_ids"].shape == (4, S) and batch["masked_lm_positions"].shape == (4, M)
        assert batch["next_sentence_weights"].shape == (4, K)
    assert all(int(b["next_sentence_weights"].sum()) == 4 for b in padded)  # one sequence per row
    assert sum(int(b["next_sentence_weights"].sum()) for b in packed) > 8 * 1.5  # ~2 per pack


@pytest.mark.slow
def test_dry_run_plans_without_a_gpu():
    out = subprocess.run(
        [sys.executable, "bench/bench_gpu.py", "--dry-run", "--rows", "4"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "packed: 4 rows" in out.stdout and "sampled packing factor" in out.stdout


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message needs a machine without one")
@pytest.mark.parametrize(
    "command", [["bench/bench_gpu.py", "--steps", "1"], ["bench/bench_lamb.py", "--device", "cuda"]]
)
def test_gpu_benchmarks_say_there_is_no_gpu_in_one_line(command):
    out = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.startswith("error:") and "CUDA" in out.stderr and "Traceback" not in out.stderr


def test_fp8_filter_takes_the_encoders_linear_layers_only():
    """torch._scaled_mm needs every dimension divisible by 16, the token count too; only the
    encoder's layers see rows x S tokens. The pooler (rows x K) and the MLM transform (rows x M)
    failed on the H100 for an odd number of rows."""
    from bench_gpu import fp8_linear_filter

    from packed_transformers.model import PackedBertForPreTraining, bert_config

    model = PackedBertForPreTraining(bert_config("bert-tiny"))
    chosen = {name for name, module in model.named_modules() if fp8_linear_filter(module, name)}
    linears = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    assert chosen == {name for name in linears if name.startswith("bert.encoder.")}
    assert len(chosen) == 6 * bert_config("bert-tiny").num_hidden_layers


def test_gpu_inference_bench_rehearses_on_the_cpu(tmp_path):
    """bench_gpu_inference.py's measurement, on the CPU: both sides run, the vectors agree,
    and a folder travelling without weights gets seeded ones that load."""
    import shutil

    from bench_gpu_inference import measure, random_weights

    from packed_transformers.data.assets import model_dir

    folder = tmp_path / "minilm"
    shutil.copytree(model_dir(), folder, ignore=shutil.ignore_patterns("model.safetensors"))
    random_weights(folder)
    texts = ["a short one", "a somewhat longer sentence about the news of the day", "x"] * 4
    result = measure(folder, texts, "float32", rounds=2, device="cpu")
    assert result["texts"] == 12 and result["lowest_cosine"] >= 0.99999
    assert len(result["seconds"]["encode"]) == len(result["seconds"]["packed"]) == 2
