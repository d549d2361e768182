"""Every bench `make bench` runs, run here at a tiny size: a bench cannot rot unseen.

`make bench` takes hours and nothing ran it between measurements, so a bench broken by a
change in the product (bench_finetune.py after the door's LoadedModel; after the one step)
stopped `make bench` at its line and every bench after it never ran (issue 96, item 7).
`SMOKES` holds, for each bench line of the Makefile's `bench` target, the same script with
arguments that make it seconds long; the first test holds the table to the Makefile, the
second runs each smoke in its own process and asserts it completes and prints its figures.
Sizes are tiny, so the figures mean nothing; only that the bench still runs end to end. Each
smoke runs on `small_minilm` (PACKED_ASSET_MODEL, data/assets.py): the MiniLM asset's layout at 2
layers of width 64, so a bench's every line runs in seconds (bench_int8's smoke: 49 s on MiniLM,
13 s on it, 2026-12-04, AMX Xeon).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ..conftest import REPO
from ..fixture_tokenizers import FOLDER as FIXTURES

# The Makefile's bench line (after `$(PY) `, as written) -> the smoke's arguments to the script.
# `{tmp}` is the test's own folder; `{demo}` the demo's data (`make demo-data`, built once);
# `{trained}` the session's fine-tuned classifier (conftest.py `trained`).
# bench_int8's and bench_embed --int8-peers' --calibration stay at OpenVINO int8's least (inference.openvino_graphs
# MIN_CALIBRATION_TEXTS, 24): at 20 it was refused on every CPU with VNNI.
SMOKES: dict[str, list[str]] = {
    # LP on the published histograms: tests/packing/test_packing_published.py solves the same cases
    "bench/bench_packing.py": ["bench/bench_packing.py", "--repeats", "1", "--algorithms", "spfhp", "lpfhp"],
    "bench/bench_pipeline.py --sizes 1000000 4000000 --workers 2": [
        "bench/bench_pipeline.py", "--sizes", "20000", "--workers", "1", "--folder", "{tmp}/pipeline"],
    "bench/bench_lamb.py": ["bench/bench_lamb.py", "--steps", "1", "--layers", "1"],
    "bench/bench_model.py --preset bert-base --rows 2 --steps 3": [
        "bench/bench_model.py", "--preset", "bert-mini", "--rows", "1", "--steps", "1"],
    "bench/bench_loader.py --packed $(DEMO)/packed": [
        "bench/bench_loader.py", "--packed", "{demo}/packed", "--loader-batches", "4", "--train-steps", "1",
        "--preset", "bert-mini", "--micro-batch", "2"],
    "bench/bench_demo_speedup.py --profile": [
        "bench/bench_demo_speedup.py", "--profile", "--profile-steps", "1", "--steps", "2", "--warmup", "1",
        "--set", "data.train_dir={demo}/packed",
        "--set", "data.eval_dir={demo}/eval"],
    "bench/bench_stages.py": ["bench/bench_stages.py", "--seq", "64", "--ga", "2", "--steps", "2"],
    "bench/bench_finetune.py": ["bench/bench_finetune.py", "--train-examples", "64", "--rounds", "1"],
    "bench/bench_vs_transformers.py": ["bench/bench_vs_transformers.py", "--rounds", "1", "--articles", "16",
                                       "--recipes", "trainer_grouped", "trainer_packed", "ours_packed"],
    "bench/bench_padding_ceiling.py": ["bench/bench_padding_ceiling.py", "--profiles", "1"],
    "bench/bench_flattening.py": ["bench/bench_flattening.py", "--examples", "8", "--batch", "4"],
    "bench/bench_qa.py": ["bench/bench_qa.py", "--train-windows", "16", "--infer-windows", "16", "--rounds", "1",
                          "--set", "batching.batch_size=8", "--set", "batching.eval_batch_size=8"],
    "bench/bench_serve.py --workload pairs": [
        "bench/bench_serve.py", "--workload", "pairs", "--seconds", "1", "--overload-seconds", "1", "--rounds", "1",
        "--concurrency", "4", "--train-seconds", "5", "--policies", "packed"],
    # the pairs smoke fine-tunes its model as the bench does; the mixed one serves the session's
    "bench/bench_serve.py --workload mixed": [
        "bench/bench_serve.py", "--workload", "mixed", "--seconds", "1", "--overload-seconds", "1", "--rounds", "1",
        "--concurrency", "4", "--model", "{trained}/run/model", "--policies", "packed"],
    "bench/bench_embed.py --texts 2000 --rounds 3": ["bench/bench_embed.py", "--texts", "40", "--rounds", "1"],
    "bench/bench_embed.py --texts 3000 --rounds 2 --profile paragraphs": [
        "bench/bench_embed.py", "--texts", "20", "--rounds", "1", "--profile", "paragraphs"],
    "bench/bench_embed.py --texts 2000 --rounds 2 --peers --profile $$profile": [
        "bench/bench_embed.py", "--texts", "40", "--rounds", "1", "--peers", "--profile", "mixed"],
    "bench/bench_embed.py --texts 2000 --rounds 3 --int8-peers": [
        "bench/bench_embed.py", "--texts", "40", "--rounds", "1", "--int8-peers", "--calibration", "24"],
    "bench/bench_startup.py --texts 10 --rounds 7": ["bench/bench_startup.py", "--texts", "2", "--rounds", "1"],
    "bench/bench_onnx.py --texts 1000 --rounds 3": ["bench/bench_onnx.py", "--texts", "20", "--rounds", "1",
                                                    "--profiles", "mixed"],
    "bench/bench_int8.py --texts 1000 --rounds 3": [
        "bench/bench_int8.py", "--texts", "40", "--rounds", "1", "--queries", "20", "--calibration", "24",
        "--output", "{tmp}/int8.json"],
    "bench/bench_compile.py --texts 2000": ["bench/bench_compile.py", "--texts", "8", "--passes", "1"],
    "bench/bench_compile_train.py --steps 40": ["bench/bench_compile_train.py", "--steps", "3", "--cases", "classify",
                                                "--ways", "eager", "compiled", "--set", "batching.batch_size=4"],
    "bench/bench_predict_process.py --rounds 5 --bf16": ["bench/bench_predict_process.py", "--rounds", "1", "--bf16",
                                                         "--texts", "40"],
    "bench/bench_rerank_train.py --pairs 1000 --rounds 3": ["bench/bench_rerank_train.py", "--pairs", "16",
                                                           "--eval-queries", "12", "--rounds", "1", "--batch-size", "8"],
    "bench/bench_rerank.py --queries 50 --candidates 20 --rounds 3": ["bench/bench_rerank.py", "--queries", "3",
                                                                      "--candidates", "4", "--rounds", "1"],
    "bench/profile_operators.py --texts 1000": ["bench/profile_operators.py", "--texts", "30"],
    "bench/bench_onnx_static.py --texts 1000 --calibration 300 --rounds 3": [
        "bench/bench_onnx_static.py", "--texts", "40", "--calibration", "24", "--rounds", "1"],
    "bench/bench_rerank.py --queries 50 --candidates 20 --rounds 3 --peers openvino": [
        "bench/bench_rerank.py", "--queries", "3", "--candidates", "4", "--rounds", "1", "--peers", "openvino"],
    "bench/profile_policies.py --k 16": ["bench/profile_policies.py", "--k", "16", "--batches", "2", "--queue", "64"],
    "bench/bench_families.py --texts 300 --rounds 2": [
        "bench/bench_families.py", "--families", "roberta", "--texts", "20", "--train-texts", "32", "--rounds", "1",
        "--layers", "2"],
    "bench/bench_families.py --families llama qwen3 gpt2 --compare sorted embed --texts 200 --rounds 2": [
        "bench/bench_families.py", "--families", "llama", "--compare", "sorted", "embed", "--texts", "20",
        "--rounds", "1", "--layers", "2"],
    "bench/bench_sft.py": ["bench/bench_sft.py", "--shape", "small", "--steps", "1", "--examples", "40", "--articles", "60",
                           "--rows-per-step", "1", "--parts", "packing", "sft"],
    "bench/bench_sft.py --parts sft --spread --body-chars 2400": [
        "bench/bench_sft.py", "--parts", "sft", "--spread", "--body-chars", "600", "--shape", "small", "--steps", "1",
        "--examples", "40", "--rows-per-step", "1", "--articles", "60"],
    "bench/bench_serve.py --workload embed --seconds 15 --rounds 3 --overload-seconds 20": [
        "bench/bench_serve.py", "--workload", "embed", "--seconds", "1", "--rounds", "1", "--overload-seconds", "1",
        "--concurrency", "4", "--train-seconds", "5", "--policies", "packed"],
    "bench/bench_serve_light.py --rate 7.5 --seconds 60 --rounds 2": [
        "bench/bench_serve_light.py", "--rate", "4", "--seconds", "2", "--rounds", "1"],
}  # fmt: skip


def bench_lines() -> list[str]:
    """The Makefile's `bench` target: each `$(PY) bench/...` command, as written."""
    text = (REPO / "Makefile").read_text()
    target = re.search(r"^bench:.*?\n((?:\t.*\n)+)", text, re.MULTILINE).group(1)
    return [
        m.group(1).strip()
        for m in re.finditer(r"\$\(PY\) (bench/[^;|]*?)(?:\s*\|\|.*)?(?:;.*)?$", target, re.M)
    ]


def test_every_bench_of_make_bench_has_its_smoke():
    lines = bench_lines()
    assert len(lines) >= 25, lines  # the parse found the target
    assert sorted(set(lines)) == sorted(SMOKES), (
        sorted(set(lines) - set(SMOKES)),
        sorted(set(SMOKES) - set(lines)),
    )


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The demo's packed data as `make demo-data` writes it (the loader and demo benches read it)."""
    folder = tmp_path_factory.mktemp("demo") / "demo_out"
    vocab = FIXTURES / "demo-vocab-4096.txt"  # learned once: the same ids on every run
    done = subprocess.run(["make", "-s", "demo-data", f"DEMO={folder}", f"DEMO_VOCAB={vocab}"], cwd=REPO,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


def run_smoke(line: str, tmp_path, request) -> None:
    """The smoke of `line` on `small_minilm`, its shared folders ({demo}, {trained}) built on first use."""
    wanted = " ".join(SMOKES[line])
    shared = {name: request.getfixturevalue(name) if "{" + name + "}" in wanted else None
              for name in ("demo", "trained")}  # fmt: skip
    arguments = [a.format(tmp=tmp_path, **shared) for a in SMOKES[line]]
    env = dict(os.environ, PACKED_ASSET_MODEL=str(request.getfixturevalue("small_minilm")))
    done = subprocess.run([sys.executable, *arguments], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, f"{' '.join(arguments)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    assert re.search(r"\d", done.stdout), f"{' '.join(arguments)} printed no figure:\n{done.stdout[-2000:]}"


# Two halves of similar length, each a class: the suite's workers (--dist loadscope) take one
# each; the two that read the demo's data in the first (one worker builds it).
ON_DEMO = [line for line in sorted(SMOKES) if "{demo}" in " ".join(SMOKES[line])]
REST = [line for line in sorted(SMOKES) if line not in ON_DEMO]
HALF = ON_DEMO + REST[1::2], REST[::2]


@pytest.mark.slow
class TestBenchesRunToTheirEnd:
    @pytest.mark.parametrize("line", HALF[0], ids=lambda line: line.replace("bench/", "")[:60])
    def test_at_a_tiny_size(self, line, tmp_path, request):
        run_smoke(line, tmp_path, request)


@pytest.mark.slow
class TestTheOtherBenchesRunToTheirEnd:
    @pytest.mark.parametrize("line", HALF[1], ids=lambda line: line.replace("bench/", "")[:60])
    def test_at_a_tiny_size(self, line, tmp_path, request):
        run_smoke(line, tmp_path, request)
