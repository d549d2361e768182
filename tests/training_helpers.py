"""Shared by the training tests: a small packed dataset, a config writer, a runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml
from safetensors.torch import load_file

from packed_transformers.data.synthetic import synthetic_rows
from packed_transformers.packing.pipeline import PackJob, run_pack
from packed_transformers.packs.unpacked_hdf5 import write_unpacked_shard

from .conftest import REPO
from .processes import run_in_group, run_together

S, P, VOCAB = 64, 10, 1200


def make_packed(root: Path) -> Path:
    """Small packed train and eval sets (vocabulary of 1,200 tokens, S=64, K=3)."""
    rng = np.random.default_rng(5)
    for name, n in (("train", 600), ("eval", 120)):
        rows = synthetic_rows(rng.integers(5, S + 1, size=n), S, P, rng, vocab_size=VOCAB)
        (root / f"raw-{name}").mkdir()
        write_unpacked_shard(root / f"raw-{name}" / "part-00000.h5", rows)
        job = PackJob(
            inputs=(str(root / f"raw-{name}" / "part-00000.h5"),),
            output=str(root / name),
            algorithm="lpfhp",
            max_sequences_per_pack=3,
            max_sequence_length=S,
            max_predictions_per_seq=P,
            seed=1,
            shard_size=100,
            vocab_size=VOCAB,
        )
        run_pack(job, quiet=True)
    return root


DECODER_S, DECODER_VOCAB = 32, 50


def decoder_rows(folder: Path, lengths=(5, 9, 30, 3, 12, 40, 7, 7, 20, 11) * 4, seed=0) -> Path:
    """A small folder of decoder rows (`packed pack-documents`' format, documents layout, S=32,
    a vocabulary of 50), written in this process from random documents."""
    from packed_transformers.packs.lm_rows.layouts import document_rows
    from packed_transformers.packs.lm_rows.store import write_rows

    rng = np.random.default_rng(seed)
    tokens = [rng.integers(1, DECODER_VOCAB, n).astype(np.int32) for n in lengths]
    rows = document_rows(tokens, DECODER_S, depth=None)
    write_rows(folder, rows, DECODER_VOCAB, 0, {"role": "train", "documents_in": len(tokens)})
    return folder


def pretrain_decoder(root: Path, output: Path, *sets, resume=False, torchrun=0, two_nodes=False):
    """run_pretraining.py on configs/pretrain_decoder_tiny.yaml over decoder_rows' train/ and
    eval/ under `root` (a one-layer model of width 16, S=32, two steps unless set)."""
    settings = [f"data.train_dir={root / 'train'}", f"data.eval_dir={root / 'eval'}",
                f"data.max_sequence_length={DECODER_S}", "eval.rows=2", "model.hidden_size=16",
                "model.intermediate_size=32", "model.num_hidden_layers=1", "training.log_every_steps=1",
                "training.max_steps=2", "eval.every_samples=4", *sets]  # fmt: skip
    extra = [a for s in settings for a in ("--set", s)] + (["--resume"] if resume else [])
    if two_nodes:
        return run_two_nodes(REPO / "configs/pretrain_decoder_tiny.yaml", output, *extra)
    return run(REPO / "configs/pretrain_decoder_tiny.yaml", output, *extra, torchrun=torchrun)


def base_config(packed: Path, **sections) -> dict:
    """The tests' raw config (tiny BERT, CPU, S=64) with `sections` merged in."""
    config = {
        "model": {"preset": "bert-tiny", "vocab_size": VOCAB, "attention_backend": "sdpa"},
        "data": {
            "train_dir": str(packed / "train"),
            "eval_dir": str(packed / "eval"),
            "micro_batch_packs": 4,
            "loader_workers": 0,
            "max_sequence_length": S,
        },
        "optim": {
            "lr": 0.01,
            "warmup_samples": 0,
            "total_samples": 100000,
            "gradient_accumulation": 2,
            "packing_adjustment": "none",
        },
        "training": {"max_steps": 6, "log_every_steps": 1, "seed": 3},
        "eval": {"every_samples": 10**9, "max_sequences": 100, "at_end": False},
        "execution": {"device": "cpu", "threads": 1},
        "logging": {"progress": False, "tensorboard": False, "mlperf": True},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return config


def write_config(path: Path, packed: Path, **sections) -> Path:
    path.write_text(yaml.safe_dump(base_config(packed, **sections)))
    return path


def run(config: Path, output: Path, *extra, torchrun: int = 0, wait=True, fresh_process=False):
    """run_pretraining.py with these arguments -> subprocess.CompletedProcess (returncode,
    stdout, stderr). In this process (`run_here`) unless the test needs a process of its
    own: torchrun replicas, a run to signal or kill (wait=False), or fresh_process=True
    (a lock held by another process, a fresh interpreter's imports)."""
    if not (torchrun or not wait or fresh_process):
        return run_here(config, output, *extra)
    if torchrun:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",  # the rendezvous on a free port torchrun picks, never another test's
            "--nproc-per-node",
            str(torchrun),
            "run_pretraining.py",
        ]
    else:
        cmd = [sys.executable, "run_pretraining.py"]
    cmd += ["--config", str(config), "--output-dir", str(output), *extra]
    # The repository first, then whatever the caller's PYTHONPATH holds (packages installed
    # with --target, as on the GPU machine): replacing it would hide them from the run.
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
    if not wait:
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    # in a process group of its own: no rank outlives the run (tests/processes.py)
    return run_in_group(cmd, timeout=600, cwd=REPO, env=env)


def run_two_nodes(config: Path, output: Path, *extra) -> subprocess.CompletedProcess:
    """run_pretraining.py as a job of two nodes with one rank each, both on this machine: two
    torchrun launchers (`--nnodes 2 --node-rank 0|1`) meeting at a static rendezvous on
    127.0.0.1, as two hosts meet at their first host's address. -> node 0's process (its
    stderr followed by node 1's); returncode: the first nonzero of the two."""
    import socket

    with socket.socket() as probe:  # a free port for node 0's store (taken again at once by it)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nodes = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "run_pretraining.py", "--config", str(config), "--output-dir", str(output), *extra]
        for rank in (0, 1)
    ]  # fmt: skip
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
    first, second = run_together(nodes, timeout=600, cwd=REPO, env=env)
    code = first.returncode or second.returncode
    return subprocess.CompletedProcess(first.args, code, first.stdout, first.stderr + second.stderr)


def final_weights(output: Path) -> dict:
    newest = sorted((output / "checkpoints").glob("step-*"))[-1]
    return load_file(newest / "model" / "model.safetensors")


def metrics(output: Path, kind="train") -> list[dict]:
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"  # run_pretraining.py's


def run_here(config: Path, output: Path, *extra) -> subprocess.CompletedProcess:
    """run_pretraining.main in this process, returning what the command's process would
    give: its exit code (1 and the traceback on stderr for an uncaught exception, argparse's
    2 for bad arguments), stdout, and stderr with the log lines. It saves an interpreter
    start and the torch import (seconds) per run. What the run changes in the process is
    put back: torch's thread count (the run sets execution.threads), signal handlers
    (the run installs its own for SIGTERM / SIGINT), the root logger, the working folder,
    and the output-folder locks it took (released, as at the end of its process)."""
    import contextlib
    import io
    import logging
    import signal
    import traceback

    import torch

    from packed_transformers import run_pretraining
    from packed_transformers.common import files

    argv = ["--config", str(config), "--output-dir", str(output), *extra]
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    saved = (root.level, torch.get_num_threads(), os.getcwd(),
             {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)})  # fmt: skip
    locks_before = set(files._HELD)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = run_pretraining.main(argv)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
            except Exception:  # what the interpreter would print, and its exit code
                traceback.print_exc()
                code = 1
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        torch.set_num_threads(saved[1])
        os.chdir(saved[2])
        for number, previous in saved[3].items():
            signal.signal(number, previous)
        # The command's process would end here, and the OS would release its folder locks.
        for path in set(files._HELD) - locks_before:
            files._HELD.pop(path).close()
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def damage_newest_weights(output: Path) -> Path:
    """The newest checkpoint's model.safetensors replaced by bytes that do not load, its
    manifest rewritten to match them (damage a sha256 check cannot see): the checkpoint."""
    from packed_transformers.common.files import sha256_file

    newest = sorted((output / "checkpoints").glob("step-*"))[-1]
    weights = newest / "model" / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["model/model.safetensors"] = {
        "bytes": weights.stat().st_size,
        "sha256": sha256_file(weights),
    }
    (newest / "manifest.json").write_text(json.dumps(manifest))
    return newest
