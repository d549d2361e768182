"""How far inference is from this CPU's matrix-multiply speed: the runner's model FLOP/s on
real tokens against torch.matmul's at the model's own shapes, fp32 and bf16.

    python bench/bench_flops.py --model FOLDER --input TEXTS.jsonl [--threads 2]

Model FLOPs per real token: each layer's dense matrices (2 x (4 H^2 + 2 H I) multiply-adds)
plus its attention over the sequence's own tokens (2 x 2 x L x H), summed over the input's
lengths; padding and attention over other sequences of a packed row are not counted (they
are the waste). The matmul reference is the best of repeated [4096, H] x [H, I] products.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def matmul_flops(h: int, i: int, dtype, threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(4096, h, dtype=dtype), torch.randn(h, i, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(10):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * 4096 * h * i / best


def main() -> int:
    import numpy as np
    import torch

    from packed_transformers.door.folder import load_finetuned

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--input", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    loaded = load_finetuned(args.model)
    config = loaded.model.config
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    from packed_transformers.data.classification_data import read_jsonl

    examples = read_jsonl(args.input, "text", "text_pair", None, need_labels=False)
    lengths = loaded.tokenize(examples, np.zeros(len(examples)), 512, "truncate").lengths
    flops = float(sum(layers * (2 * (4 * h * h + 2 * h * i) * n + 4 * n * n * h) for n in lengths))
    sys.path.insert(0, str(REPO / "bench"))
    import machine

    print(f"# {machine.line(machine.description())}")
    print(f"# {args.model}: H={h}, I={i}, {layers} layers; {len(lengths)} texts, {int(lengths.sum())} real tokens, "
          f"{flops / 1e12:.3f} TFLOP; {args.threads} threads")  # fmt: skip
    print(
        "| dtype | predict inference loop, s | model GFLOP/s on real tokens | matmul GFLOP/s at [4096, H] x [H, I] | share |"
    )
    print("|---|---|---|---|---|")
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        out = Path("/tmp") / f"flops_{dtype}.jsonl"
        done = subprocess.run(
            [sys.executable, "-m", "packed_transformers.finetune.predict", "--model", str(args.model), "--input", str(args.input),
             "--output", str(out), "--dtype", dtype], cwd=REPO, capture_output=True, text=True,
            env={"OMP_NUM_THREADS": str(args.threads), "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        if (
            done.returncode == 2 and "no bf16 instructions" in done.stderr
        ):  # an AVX2-only CPU: refused, as users see it
            print(f"| {dtype} | refused on this CPU (no AVX512-BF16 / AMX) | | | |")
            continue
        if done.returncode != 0:
            raise SystemExit(f"finetune.predict failed ({done.returncode}): {done.stderr.strip()[-1500:]}")
        seconds = json.loads(done.stdout)["seconds"]
        peak = matmul_flops(h, i, torch_dtype, args.threads)
        model = flops / seconds
        print(f"| {dtype} | {seconds:.2f} | {model / 1e9:.0f} | {peak / 1e9:.0f} | {model / peak:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
