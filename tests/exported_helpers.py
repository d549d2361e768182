"""What the tests of exported folders share (tests/inference/test_exported*.py): texts of the
tiny vocabulary, and the fresh process that says which heavy packages a command imported."""

from __future__ import annotations

import numpy as np

from .finetune_helpers import WORDS


def tiny_texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 40)))) for _ in range(n)]


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
