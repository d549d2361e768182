"""The README's recipes run as written, at tiny scale, so the README cannot drift from the code.

Every ```bash block preceded by `<!-- readme-test: NAME -->` is run command by command
(continuation lines joined, comments dropped) in a scratch folder that holds the
repository's configs/, examples/, packed_transformers/ and run_pretraining.py, with .venv's python and
`packed` first on PATH, as a user who followed "Install" would. The only changes are scale: fewer
passes over the text, a few training steps, one fine-tuning epoch (TINY below), and the
MiniLM asset's layout at 2 layers of width 64 in its place (conftest.small_minilm through
PACKED_ASSET_MODEL, which `packed assets model` and `asset:model` follow). The
user's own text ("my_text/*.txt") is BBC News written in the documented input format.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from packed_transformers.data.assets import write_my_text  # what `packed assets my-text my_text` writes

from ..conftest import REPO

pytestmark = pytest.mark.slow

TESTED = ("own-text", "finetune", "sft", "qa", "pack", "embed", "embed-train", "rerank", "decoder-pretrain")

# (command prefix, what is appended or replaced) -> the same command at tiny scale
TINY = {
    "packed create-pretraining-data": [("--dupe-factor 5", "--dupe-factor 1")],
    "packed pretrain --config configs/pretrain_own_text.yaml": [
        (
            "",
            " --set model.preset=bert-tiny --set training.max_steps=4 --set training.log_every_steps=1"
            " --set eval.every_samples=64 --set eval.max_sequences=64 --set logging.progress=false",
        )
    ],
    "packed train": [("", " --set training.epochs=1 --set training.progress=false")],
    "packed train --config configs/finetune_own.yaml": [("", " --set training.max_seconds=2")],
    "packed embedding-texts --output work/texts.jsonl": [("--limit 5000", "--limit 64")],
    "packed embedding-texts --kind pairs --output work/pairs.jsonl": [("", " --limit 40")],
    "packed embedding-texts --kind pairs --output work/rerank_pairs.jsonl": [("--limit 300", "--limit 40")],
    "packed train --config configs/finetune_rerank.yaml": [("", " --set data.max_sequence_length=64")],
    "packed train --config configs/finetune_embedding.yaml": [
        ("", " --set data.max_sequence_length=64 --set batching.batch_size=8")
    ],
    "packed qa-cloze": [("--questions-per-article 1", "--questions-per-article 1 --dev-fraction 0.03")],
    "packed train --config configs/finetune_qa_bbc.yaml": [("max_seconds=90", "max_seconds=2")],
    "packed debian-texts": [("", " --limit 1500")],
    "packed pack-documents": [("", " --max-sequence-length 512 --eval-rows 8")],
    **{
        f"packed pretrain --config configs/{config}": [
            (
                "",
                " --set data.max_sequence_length=512 --set eval.rows=8 --set training.max_steps=3"
                " --set eval.every_samples=2 --set model.hidden_size=32 --set model.intermediate_size=64",
            )
        ]
        for config in ("pretrain_decoder_tiny.yaml", "pretrain_decoder_tiny_closed.yaml")
    },
}


def readme_blocks() -> dict[str, list[str]]:
    """{name: [command, ...]} of the README's marked bash blocks."""
    text = (REPO / "README.md").read_text()
    blocks = {}
    for match in re.finditer(r"<!-- readme-test: ([\w-]+) -->\n```bash\n(.*?)```", text, re.S):
        joined = match.group(2).replace("\\\n", " ")
        commands = [line.split("  #")[0].strip() for line in joined.splitlines()]
        blocks[match.group(1)] = [c for c in commands if c and not c.startswith("#")]
    return blocks


# README_AS_WRITTEN=1 (`make readme-timings`): every command exactly as the README gives it,
# each recipe's wall time printed and added to README_TIMINGS (a JSON file): the times the
# README writes next to its recipes. `make test` runs them at tiny scale.
AS_WRITTEN = os.environ.get("README_AS_WRITTEN") == "1"


def at_tiny_scale(command: str) -> str:
    if AS_WRITTEN:
        return command
    for prefix, changes in TINY.items():
        if command == prefix or command.startswith(prefix + " "):
            for old, new in changes:
                if old:
                    assert old in command, f"the README no longer says {old!r}: update TINY"
                    command = command.replace(old, new)
                else:
                    command += new
    return command


def test_every_recipe_is_marked_for_this_test():
    assert set(readme_blocks()) == set(TESTED)


# Recipes run in these groups, each in its own scratch folder (pack reads own-text's shards),
# so that the groups can run on different test workers.
GROUPS = {
    "pretraining": ("own-text", "pack"),
    "finetune": ("finetune", "sft"),
    "qa": ("qa",),
    "embed": ("embed", "embed-train", "rerank"),
    "decoder-pretrain": ("decoder-pretrain",),
}


def test_groups_cover_every_recipe():
    assert sorted(r for group in GROUPS.values() for r in group) == sorted(TESTED)


def run_recipes(tmp_path, names, small_model: Path | None) -> None:
    for name in ("configs", "examples", "packed_transformers", "run_pretraining.py"):
        (tmp_path / name).symlink_to(REPO / name)
    write_my_text(tmp_path / "my_text")
    env = dict(os.environ, PYTHONPATH=str(REPO), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    if not AS_WRITTEN:
        env["PACKED_ASSET_MODEL"] = str(small_model)
    blocks = readme_blocks()
    for name in names:
        load_at_start = os.getloadavg()[0]  # the load each stated time ran at, recorded with it
        started = time.perf_counter()
        for command in blocks[name]:
            if command.startswith("apt-get update") and not AS_WRITTEN:
                continue  # the machine's apt lists as they are (a test does not refresh them)
            if command.startswith("python -m mlperf_logging.compliance_checker") and not AS_WRITTEN:
                # at tiny scale the log fails exactly the rules that need MLPerf's scale
                from ..decoder_helpers import SCALE_RULES, failed_mlperf_rules

                assert failed_mlperf_rules(tmp_path / command.split()[-1]) <= SCALE_RULES
                continue
            command = at_tiny_scale(command)
            result = subprocess.run(
                ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
            )
            assert result.returncode == 0, (
                f"README {name}: {command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
            )
        if AS_WRITTEN:
            record_time(name, time.perf_counter() - started, load_at_start)


def record_time(recipe: str, seconds: float, load_at_start: float) -> None:
    """README_TIMINGS[recipe] = {seconds, the 1-minute load average when it started, cores,
    date}: a stated time comes with the load it ran at."""
    print(f"README recipe {recipe}: {seconds:.0f} s as written (load {load_at_start:.2f} at its start)")
    path = Path(os.environ.get("README_TIMINGS", REPO / "work" / "readme_timings.json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    times = json.loads(path.read_text()) if path.exists() else {}
    times[recipe] = {
        "seconds": round(seconds, 1),
        "load_1min_at_start": round(load_at_start, 2),
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }
    path.write_text(json.dumps(times, indent=1) + "\n")


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_readme_recipes_run_as_written(tmp_path, group, request):
    small_model = None if AS_WRITTEN else request.getfixturevalue("small_minilm")
    run_recipes(tmp_path, GROUPS[group], small_model)
    # What the recipes promise to leave behind.
    if group == "pretraining":
        assert (tmp_path / "runs/own_text/metrics.jsonl").is_file()
        assert (tmp_path / "work/roundtrip").is_dir()
    elif group == "finetune":
        assert (tmp_path / "runs/my_classifier/model/config.json").is_file()
        if AS_WRITTEN:  # the first fine-tune visibly learns (issue 61: >= 0.8 in <= 3 minutes)
            assert (
                json.loads((tmp_path / "runs/my_classifier/summary.json").read_text())["validation_accuracy"]
                >= 0.8
            )
        predictions = (tmp_path / "work/predictions.jsonl").read_text().splitlines()
        assert len(predictions) == len((REPO / "examples/classify/new_texts.jsonl").read_text().splitlines())
        summary = json.loads((tmp_path / "runs/my_sft/summary.json").read_text())
        assert summary["task"] == "causal_lm" and summary["train_examples"] == 108  # 120 lines, 10% held out
        assert (tmp_path / "runs/my_sft/model/tokenizer_config.json").is_file()
    elif group == "decoder-pretrain":
        report = json.loads((tmp_path / "work/lm/report.json").read_text())
        assert report["layouts"]["documents"]["eval"]["rows"] == (1024 if AS_WRITTEN else 8)
        assert (tmp_path / "runs/decoder_tiny/mlperf.log").is_file()
    elif group == "qa":
        answers = json.loads((tmp_path / "work/qa_predictions.json").read_text())
        dev = json.loads((tmp_path / "demo_qa/dev.json").read_text())
        assert len(answers) == sum(len(p["qas"]) for a in dev["data"] for p in a["paragraphs"]) > 40
    else:
        import numpy as np

        lines = len((tmp_path / "work/texts.jsonl").read_text().splitlines())
        width = 384 if AS_WRITTEN else json.loads((small_model / "config.json").read_text())["hidden_size"]
        assert np.load(tmp_path / "work/embeddings.npy").shape == (lines, width)
        assert np.load(tmp_path / "work/embeddings-int8.npy").shape == (lines, width)
        summary = json.loads((tmp_path / "runs/my_embedder/summary.json").read_text())
        assert summary["task"] == "embedding" and (tmp_path / "runs/my_embedder/model/modules.json").is_file()
        summary = json.loads((tmp_path / "runs/my_reranker/summary.json").read_text())
        assert summary["task"] == "rerank" and summary["validation_queries"] == (60 if AS_WRITTEN else 8)
        assert (tmp_path / "runs/my_reranker/model/config.json").is_file()
        assert lines == (5000 if AS_WRITTEN else 64)


def test_a_pip_user_runs_the_recipes_from_an_empty_folder(tmp_path, request):
    """Issue 110 item 1: the package built as a wheel and installed outside the repository
    (`pip install --target`, its dependencies those of .venv), then in an empty folder
    `packed recipes` and recipe 2's and the embedding recipe's commands as the README gives
    them (at tiny scale): no config, input or script comes from the repository."""
    import shutil

    source = tmp_path / "source"  # a copy: setuptools stages its build/ beside the sources
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "runs", "demo_out", "demo_qa", "work", "build", "*.egg-info", "__pycache__", "tests",
        "docs", "bench"))  # fmt: skip
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w", str(tmp_path)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    site = tmp_path / "site"
    wheel = next(tmp_path.glob("packed_transformers-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    user = tmp_path / "user"
    user.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), PATH=f"{site / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               PACKED_ASSET_MODEL=str(request.getfixturevalue("small_minilm")))  # fmt: skip
    where = subprocess.run([sys.executable, "-c", "import packed_transformers; print(packed_transformers.__file__)"],
                           cwd=user, env=env, capture_output=True, text=True, check=True)  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(site), (
        where.stdout
    )  # the installed copy, not the repository's
    blocks = readme_blocks()
    commands = ["packed recipes", *blocks["finetune"][:3], *blocks["embed-train"]]
    for command in commands:
        done = subprocess.run(["bash", "-c", at_tiny_scale(command)], cwd=user, env=env, capture_output=True,
                              text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert (user / "configs/finetune_own.yaml").read_bytes() == (
        REPO / "configs/finetune_own.yaml"
    ).read_bytes()
    assert (user / "runs/my_classifier/model/config.json").is_file()
    assert len((user / "work/predictions.jsonl").read_text().splitlines()) == len(
        (REPO / "examples/classify/new_texts.jsonl").read_text().splitlines()
    )
    assert (user / "runs/my_embedder/model/modules.json").is_file()
