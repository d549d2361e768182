"""What a user's first commands meet: path mistakes and mistyped options in one line without
importing torch, options read as argparse reads them, CUDA without a GPU, a Python without the
project's packages told what to run."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from packed_transformers.common.cli import no_gpu
from packed_transformers.common.preflight import path_mistake, value_of

from ..conftest import REPO


def run(*argv, timeout=60):
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *map(str, argv)], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    return done, time.perf_counter() - started


@pytest.mark.parametrize(
    "argv, says",
    [
        (["-m", "packed_transformers.finetune.train", "--config", "configs/dmeo.yaml", "--output-dir", "x"], "--config configs/dmeo.yaml: file not found"),
        (["-m", "packed_transformers.finetune.predict", "--model", "runs/my_clasifier/model", "--input", "README.md", "--output", "o"],
         "--model runs/my_clasifier/model: no such folder"),
        (["-m", "packed_transformers.finetune.embed", "--model", "sentence-transformers/all-MiniLM-L6-v2", "--input", "README.md", "--output", "o"],
         "looks like a Hugging Face Hub id, and models are not downloaded here: fetch it first (hf download "),
        (["-m", "packed_transformers.serving", "--model", "README.md"], "--model README.md: not a folder"),
        (["run_pretraining.py", "--config", "configs/nope.yaml"], "--config configs/nope.yaml: file not found"),
        # issue 61: a CSV given as JSON lines, --device cuda on the CPU build, a bare encoder to predict
        (["-m", "packed_transformers.finetune.embed", "--model", "ASSET", "--input", "CSV", "--output", "o.npy"],
         ":1: not JSON lines (it starts 'text,label'); expected one JSON object per line"),
        (["-m", "packed_transformers.finetune.embed", "--model", "ASSET", "--input", "examples/sft/train.jsonl", "--output", "o.npy",
          "--device", "cuda"], "--device cuda: this torch (2.13.0+cpu) is the CPU build"),
        (["-m", "packed_transformers.finetune.predict", "--model", "ASSET", "--input", "examples/sft/train.jsonl", "--output", "o"],
         "key 'architectures' is ['BertModel']; predict runs a *ForSequenceClassification"),
        # option mistakes: every command parses its line before its imports (commands/parsers.py)
        (["-m", "packed_transformers.finetune.predict", "--model", ".", "--input", "README.md", "--ouput", "o"],
         "unrecognized arguments: --ouput (did you mean --output?); see python -m packed_transformers.finetune.predict --help"),
        (["-m", "packed_transformers.finetune.embed", "--model", ".", "--input", "README.md"],
         "the following arguments are required: --output; see python -m packed_transformers.finetune.embed --help"),
        (["-m", "packed_transformers.finetune.embed", "--model", ".", "--input", "README.md", "--output", "o", "--batching", "pakced"],
         "argument --batching: invalid choice: 'pakced'"),
        (["-m", "packed_transformers.finetune.train", "--config", "configs/finetune_bbc.yaml", "--ouput-dir", "x"],
         "unrecognized arguments: --ouput-dir (did you mean --output-dir?)"),
        (["-m", "packed_transformers.training.summary", "--pakced", "runs/x"], "unrecognized arguments: --pakced (did you mean --packed?)"),
        (["-m", "packed_transformers.serving", "--model", ".", "--prot", "8080"], "unrecognized arguments: --prot (did you mean --port?)"),
    ],
)  # fmt: skip
def test_path_mistakes_are_one_line_without_importing_torch(argv, says, tmp_path):
    from importlib.metadata import version

    from packed_transformers.data.assets import model_dir

    if "cuda" in argv and "+cpu" not in version("torch"):
        pytest.skip("the CPU-build line needs the CPU build of torch")
    (tmp_path / "a.csv").write_text("text,label\nhello,positive\n")
    argv = [{"ASSET": str(model_dir()), "CSV": str(tmp_path / "a.csv")}.get(word, word) for word in argv]
    done, _ = run("-X", "importtime", *argv)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], done.stderr[-500:]
    imported = {
        line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")
    }
    assert "torch" not in imported and "transformers" not in imported


def test_the_preflight_reads_options_as_argparse_does():
    assert value_of(["--model", "a", "--model=b"], "--model") == "b"
    assert value_of(["--input", "x"], "--model") is None
    assert path_mistake("--model", str(REPO), "folder") is None
    assert "is a directory" in path_mistake("--input", str(REPO), "file")


def test_one_message_for_cuda_without_a_gpu():
    message = no_gpu("--device cuda", "2.13.0+cpu", cuda_build=False)
    assert "CPU build" in message and "download.pytorch.org/whl/cu130" in message
    import torch

    from packed_transformers.inference.precision import device_problem

    if not torch.cuda.is_available():
        assert device_problem("cuda") == no_gpu(
            "--device cuda", torch.__version__, torch.version.cuda is not None
        )


def test_a_python_without_the_projects_packages_is_told_what_to_run(tmp_path):
    from packed_transformers.common.preflight import missing_packages

    assert missing_packages(("json",)) is None
    assert "not_a_package_here not installed" in missing_packages(("not_a_package_here",))
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    done = subprocess.run([str(bare / "bin" / "python"), "-m", "packed_transformers.finetune.predict", "--model", "m", "--input", "i",
                           "--output", "o"], cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: torch, transformers not installed in this Python ({bare / 'bin' / 'python'}): this command needs "
        "the full install (pip install packed-transformers with its dependencies; in a clone: make install, then "
        ".venv/bin/python)"
    ]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["-m", "packed_transformers.finetune.predict", "--model", ".", "--input", "examples/sft/train.jsonl", "--ouput", "o"],
         "error: unrecognized arguments: --ouput (did you mean --output?); see python -m packed_transformers.finetune.predict --help"),
        (["-m", "packed_transformers.finetune.embed", "--model", ".", "--input", "examples/sft/train.jsonl"],
         "error: the following arguments are required: --output; see python -m packed_transformers.finetune.embed --help"),
    ],
)  # fmt: skip
def test_a_mistyped_or_missing_option_is_one_line_naming_the_nearest(argv, says):
    """argparse's usage block is replaced by one line; a typo names the option meant, and is
    named before the required option it hides."""
    done, _ = run(*argv)
    assert done.returncode == 2 and done.stderr.strip() == says, done.stderr[-500:]


def test_a_closed_pipe_is_not_a_traceback(tmp_path):
    """`packed --help | head -1` (and `python -m packed_transformers`): the output cut off by
    the reader ends quietly (it printed a BrokenPipeError traceback)."""
    import os
    from pathlib import Path

    err = tmp_path / "err.txt"
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    for command in ("packed", f"{sys.executable} -m packed_transformers"):
        done = subprocess.run(["bash", "-c", f"{command} --help 2>{err} | head -1"], capture_output=True, text=True,
                              env={**os.environ, "PATH": path})  # fmt: skip
        assert done.stdout.startswith("usage: packed") and done.stdout.count("\n") == 1
        assert err.read_text() == "", err.read_text()
        # a reader gone before the first byte (Python starts in ~0.1 s): every write fails
        done = subprocess.run(["bash", "-c", f"{command} --help 2>{err} | true; echo ${{PIPESTATUS[0]}}"],
                              capture_output=True, text=True, env={**os.environ, "PATH": path})  # fmt: skip
        assert done.stdout.strip() == "141" and err.read_text() == "", (done.stdout, err.read_text())
