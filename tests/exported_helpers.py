"""What the tests of exported folders share (tests/inference/test_exported*.py): texts of the
tiny vocabulary, a classifier's predictions compared with its exported folder's, and the fresh
process that says which heavy packages a command imported."""

from __future__ import annotations

import json

import numpy as np

from .finetune_helpers import WORDS


def tiny_texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 40)))) for _ in range(n)]


def assert_predicts_as_torch(trained, folder, tmp_path) -> dict:
    """`packed predict` on the session's classifier (trained/run/model) and on its exported
    `folder`, over trained/val.jsonl: the same labels, every score within 2e-6 -> the exported
    run's summary."""
    from packed_transformers.commands import predict as predict_command

    outputs = {}
    for name, source in (("torch", trained / "run" / "model"), ("exported", folder)):
        out = tmp_path / f"{name}.jsonl"
        assert predict_command.main(["--model", str(source), "--input", str(trained / "val.jsonl"),
                                     "--output", str(out)]) == 0  # fmt: skip
        outputs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in outputs["exported"]] == [r["label"] for r in outputs["torch"]]
    for ours, theirs in zip(outputs["exported"], outputs["torch"]):
        for label, value in theirs["scores"].items():
            assert abs(ours["scores"][label] - value) <= 2e-6
    return json.loads((tmp_path / "exported.summary.json").read_text())


# A fresh interpreter runs a command on the exported folder, then says which of the heavy
# packages it imported: the test judges the process, not our import lists.
NO_TORCH = """
import runpy, sys, json
sys.argv = ["packed", *json.loads(sys.argv[1])]
try:
    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
except SystemExit as done:
    code = done.code
print(json.dumps({"code": code, "imported": sorted(m for m in ("torch", "transformers", "openvino")
                                                   if m in sys.modules)}), file=sys.stderr)
"""
