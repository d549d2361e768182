"""Fine-tuning's small labelled data and config, shared by the test modules that fine-tune
(the tiny BERT they start from is conftest.py's `checkpoint` fixture), and a run over torchrun's
processes compared with one process's."""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np
import yaml

from .conftest import REPO
from .processes import run_in_group

WORDS = "the a market shares profit bank film music award star match goal team win game vote party".split()


TOPIC = {0: ["market", "shares", "profit", "bank"], 1: ["film", "music", "award", "star"],
         2: ["match", "goal", "team", "win"]}  # fmt: skip


CLASSES = ["business", "culture", "sport"]


def write_config(tmp_path, checkpoint, **sections):
    config = {
        "model": {"init_checkpoint": str(checkpoint), "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "data": {
            "source": "jsonl",
            "train_file": str(write_jsonl(tmp_path / "train.jsonl", 120, 0)),
            "validation_file": str(write_jsonl(tmp_path / "val.jsonl", 30, 1)),
            "max_sequence_length": 32,
        },
        "batching": {"batch_size": 8, "max_sequences_per_pack": 4},
        "optim": {"lr": 3e-3},
        "training": {"epochs": 8, "progress": False},
    }
    for section, values in sections.items():
        config[section].update(values)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def write_jsonl(path, n, seed, labels=True, label_of=None):
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        c = int(rng.integers(0, 3))
        words = list(rng.choice(TOPIC[c], size=int(rng.integers(1, 4)))) + list(
            rng.choice(["the", "a"], size=int(rng.integers(0, 20)))
        )
        record = {"text": " ".join(words)}
        if rng.random() < 0.5:
            record["text_pair"] = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 8))))
        if labels:
            record["label"] = label_of(c) if label_of else CLASSES[c]
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


class StopAfter:
    """A stop flag that turns on after `steps` polls: SIGTERM between two given steps."""

    signum = signal.SIGTERM

    def __init__(self, steps: int):
        self.polls, self.steps = 0, steps

    def is_set(self) -> bool:
        self.polls += 1
        return self.polls > self.steps


def torchrun(config_path, output, *extra, processes=2, module="packed_transformers.finetune.train", env=None):
    """`finetune.train` (or `module`, which runs it: tests/finetune/counted_gathers.py) over
    torchrun's processes (in a process group of its own), `env` added to their environment."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
               "-m", module, "--config", str(config_path), "--output-dir", str(output), *extra]  # fmt: skip
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath, **(env or {}))
    return run_in_group(command, timeout=600, cwd=REPO, env=env)


def assert_same_run(a, b, epochs=2, atol=1e-5, zero_gradient=(), discrete=None, strict=()):
    """Two finished runs wrote the same metrics lines and final weights, within `atol`.
    zero_gradient: weights whose gradient is 0 but for rounding (a shift the loss cannot see):
    AdamW turns two runs' different rounding noise into steps of lr's size, so they are not
    compared. discrete: {metric: tolerance} for a count of argmax hits, which a near tie at
    rounding level may flip by one (a random tiny model scores its candidates nearly alike);
    strict: metrics held to 1e-5 whatever `atol` allows the weights."""
    import torch
    from safetensors.torch import load_file

    lines = [
        [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for run in (a, b)
    ]
    assert len(lines[0]) == len(lines[1]) == epochs
    for one, other in zip(*lines, strict=True):
        assert one.keys() == other.keys() and one["step"] == other["step"]
        for key, value in one.items():
            tolerance = 1e-5 if key in strict else (discrete or {}).get(key, atol)
            assert abs(value - other[key]) <= tolerance + 1e-12, (key, value, other[key])
    wa, wb = (load_file(str(run / "model" / "model.safetensors")) for run in (a, b))
    assert wa.keys() == wb.keys()
    for name in set(wa) - set(zero_gradient):
        assert torch.allclose(wa[name], wb[name], rtol=0, atol=atol), (
            name,
            (wa[name] - wb[name]).abs().max(),
        )
