"""A newcomer's first mistakes, answered in one line before torch is imported (common/
preflight.py), and one message for CUDA without a GPU (issue: the first hour)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from packed_transformers.common.cli import no_gpu
from packed_transformers.common.preflight import path_mistake, value_of

from .conftest import REPO


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


@pytest.mark.slow
def test_embed_stopped_by_a_signal_or_a_kill_keeps_its_rows_and_continues_from_them(tmp_path, capsys):
    """SIGTERM, then SIGKILL, mid-run: one line (exit 143) saying how many rows are kept,
    nothing at the output's name; the same command run again continues after the rows
    kept and the array equals an uninterrupted run's, bit for bit (chunks pack alike)."""
    import json

    import numpy as np

    from packed_transformers.data.assets import model_dir

    texts = tmp_path / "t.jsonl"
    texts.write_text(
        "".join(json.dumps({"text": f"text number {i} " + "word " * (i % 40)}) + "\n" for i in range(600))
    )
    argv = [sys.executable, "-m", "packed_transformers.finetune.embed", "--model", str(model_dir()), "--input", str(texts),
            "--chunk-texts", "50", "--quiet"]  # fmt: skip
    state = tmp_path / ".e.npy.partial.json"

    def stopped_after(rows: int, how) -> subprocess.Popen:
        process = subprocess.Popen([*argv, "--output", str(tmp_path / "e.npy")], cwd=REPO, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if json.loads(state.read_text())["rows_written"] >= rows:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.02)
        process.send_signal(how)
        process.communicate(timeout=120)
        return process

    terminated = stopped_after(100, signal.SIGTERM)
    _, err = terminated.communicate()
    assert terminated.returncode == 143
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("interrupted: ") and "rows are kept" in last, err
    assert not (tmp_path / "e.npy").exists()
    kept = json.loads(state.read_text())["rows_written"]
    assert 100 <= kept < 600
    killed = stopped_after(kept + 150, signal.SIGKILL)  # continues, then dies without a word
    assert killed.returncode == -signal.SIGKILL and not (tmp_path / "e.npy").exists()
    done = subprocess.run(
        [*argv, "--output", str(tmp_path / "e.npy")], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0 and "continuing after the" in done.stderr, done.stderr[-2000:]
    whole = subprocess.run(
        [*argv, "--output", str(tmp_path / "whole.npy")], cwd=REPO, capture_output=True, text=True
    )
    assert whole.returncode == 0, whole.stderr[-2000:]
    np.testing.assert_array_equal(np.load(tmp_path / "e.npy"), np.load(tmp_path / "whole.npy"))
    # no partial left (the outputs' locks stay: one run per output at a time)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".lock") == [
        "e.npy",
        "t.jsonl",
        "whole.npy",
    ]
    # a finished output is never replaced without --overwrite (one line, before any model loads)
    from packed_transformers.commands import embed

    before = (tmp_path / "e.npy").stat().st_mtime_ns
    capsys.readouterr()
    assert embed.main([*argv[3:], "--output", str(tmp_path / "e.npy")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --output {tmp_path / 'e.npy'}: holds a finished output; give --overwrite to replace it, or another path"
    ]
    assert (tmp_path / "e.npy").stat().st_mtime_ns == before


@pytest.mark.slow
def test_a_time_budget_bar_counts_to_the_budget_not_to_max_steps(tmp_path):
    """Pretraining stopped by a 3 s training budget with max_steps 100,000: the bar shows the
    nearest limit's percentage (the old bar counted 14/100000 with a 28-hour ETA)."""
    from .training_helpers import make_packed, run_here, write_config

    packed = make_packed(tmp_path)
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 100_000, "max_train_seconds": 3},
                          logging={"progress": True, "tensorboard": False, "mlperf": False})  # fmt: skip
    done = run_here(config, tmp_path / "run")
    assert done.returncode == 0, done.stderr[-2000:]
    bars = [line for line in done.stderr.replace("\r", "\n").splitlines() if "of max_train_seconds" in line]
    assert bars and "100000" not in bars[-1] and "%" in bars[-1], done.stderr[-1500:]
    assert "100/100" in bars[-1] or "100.0/100" in bars[-1]


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
        f"error: torch, transformers not installed in this Python ({bare / 'bin' / 'python'}): run `make install` "
        "in the project folder, then use .venv/bin/python (or `source .venv/bin/activate`)"
    ]


@pytest.mark.slow
def test_the_mlperf_config_names_every_missing_prerequisite_at_once(tmp_path):
    """Run from an empty folder: no data, no phase-1 checkpoint, no GPU, one line for all three."""
    import shutil

    config = tmp_path / "mlperf_nvidia_8gpu_gbs768.yaml"
    shutil.copyfile(REPO / "configs" / "mlperf_nvidia_8gpu_gbs768.yaml", config)
    done = subprocess.run([sys.executable, str(REPO / "run_pretraining.py"), "--config", str(config)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr[-1000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr
    line = errors[0]
    assert "data.train_dir mlperf_data/packed_512" in line and "data.eval_dir" in line
    assert "model.init_checkpoint checkpoints/phase1_hf" in line and "See docs/mlperf.md." in line
    import torch

    if not torch.cuda.is_available():
        assert "execution.device cuda" in line and "CPU build" in line
    assert not (tmp_path / "runs").exists()


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


def test_the_news_jsonl_recipe_input_is_the_corpus_in_the_users_format(tmp_path):
    """Recipe 2's first command: every BBC article once, as {"text", "text_pair", "label"};
    a device or a folder as the output is one line, exit 2, and is left as it is."""
    import json

    from packed_transformers.data.assets import corpus_files

    done, _ = run("-m", "packed_transformers.data.assets", "news-jsonl", tmp_path / "news.jsonl")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in (tmp_path / "news.jsonl").read_text().splitlines()]
    assert len(lines) == len(corpus_files()) == 2225
    assert {line["label"] for line in lines} == {"business", "entertainment", "politics", "sports", "tech"}
    assert all(isinstance(line["text"], str) and line["text"] for line in lines)
    for output in ("/dev/null", tmp_path):
        done, _ = run("-m", "packed_transformers.data.assets", "news-jsonl", output)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "regular file" in done.stderr and "Traceback" not in done.stderr
