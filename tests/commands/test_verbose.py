"""The libraries' own noise (transformers' load reports and progress bars) is off in every
command that loads a model, and on with --verbose (issue 110 item 5)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..conftest import REPO
from ..folder_helpers import input_file

# every command that loads a model through transformers, and so can print its reports and bars
MODEL_COMMANDS = ("predict", "embed", "export", "rerank", "serve", "train", "pretrain")


def test_every_command_that_loads_a_model_takes_verbose():
    for command in MODEL_COMMANDS:
        done = subprocess.run([sys.executable, "-m", "packed_transformers", command, "--help"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0 and "--verbose" in done.stdout, (command, done.stderr[-1000:])


@pytest.mark.parametrize("verbose", [False, True])
def test_predict_leaves_the_libraries_logging_to_verbose(hub_classifier, tmp_path, verbose):
    from transformers.utils import logging as hf_logging

    from packed_transformers.commands import predict

    before, bars_before = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_warning()
    hf_logging.enable_progress_bar()
    try:
        source = input_file(tmp_path / "in.jsonl", ["a text", "another"])
        argv = [
            "--model",
            str(hub_classifier),
            "--input",
            str(source),
            "--output",
            str(tmp_path / "p.jsonl"),
            "--quiet",
        ]
        assert predict.main(argv + (["--verbose"] if verbose else [])) == 0
        assert hf_logging.get_verbosity() == (hf_logging.WARNING if verbose else hf_logging.ERROR)
        assert hf_logging.is_progress_bar_enabled() == verbose
    finally:
        hf_logging.set_verbosity(before)
        (hf_logging.enable_progress_bar if bars_before else hf_logging.disable_progress_bar)()
