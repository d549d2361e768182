"""One optimizer step over the BERT-Large parameter set (~335 M parameters):
optim.Lamb vs torch.optim.AdamW, measured alternately in one run.

    python bench/bench_lamb.py [--steps 5] [--device cpu|cuda]

CPU: against AdamW(foreach=True). CUDA: against AdamW(fused=True), the fastest torch
optimizer step (timed with torch.cuda.synchronize around each step).
Goal: Lamb step <= 1.5 x AdamW step; on CUDA, small next to a BERT-Large training step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from packed_transformers.common.constants import BERT_VOCAB_SIZE
from packed_transformers.optim import Lamb  # noqa: E402


def bert_large_shapes(vocab=BERT_VOCAB_SIZE, hidden=1024, layers=24, intermediate=4096, positions=512):
    shapes = [(vocab, hidden), (positions, hidden), (2, hidden), (hidden,), (hidden,)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (hidden,)] * 4  # q, k, v, attention output
        shapes += [(hidden,), (hidden,)]  # attention LayerNorm
        shapes += [(intermediate, hidden), (intermediate,), (hidden, intermediate), (hidden,)]
        shapes += [(hidden,), (hidden,)]  # output LayerNorm
    shapes += [(hidden, hidden), (hidden,), (hidden, hidden), (hidden,), (hidden,), (hidden,)]
    shapes += [(vocab,), (2, hidden), (2,)]  # MLM bias, NSP head
    return shapes


def time_steps(make_optimizer, params, steps, warmup_steps: int = 1):
    """Seconds of each of `steps` optimizer steps, after `warmup_steps` untimed ones (state
    allocation; compilation for a compiled optimizer)."""
    optimizer = make_optimizer(params)
    for _ in range(warmup_steps):
        optimizer.step()
    sync = torch.cuda.synchronize if params[0].is_cuda else (lambda: None)
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        optimizer.step()
        sync()
        times.append(time.perf_counter() - start)
    del optimizer
    return times


def main():
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--layers", type=int, default=24, help="encoder layers' parameters (BERT-Large: 24)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"error: --device cuda: torch {torch.__version__} sees no CUDA GPU here; use --device cpu, or the "
            "CUDA wheel (README: Install) on a GPU machine",
            file=sys.stderr,
        )
        raise SystemExit(2)
    torch.manual_seed(0)
    device = torch.device(args.device)
    params = [
        torch.nn.Parameter(torch.randn(s, device=device) * 0.02)
        for s in bert_large_shapes(layers=args.layers)
    ]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    count = sum(p.numel() for p in params)
    where = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, threads {torch.get_num_threads()}"
    )
    print(f"parameters: {count / 1e6:.1f} M in {len(params)} tensors, {where}, torch {torch.__version__}")
    makers = {
        "AdamW(foreach=True)": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
        "Lamb": lambda ps: Lamb(ps, lr=1e-4),
        "Lamb(max_grad_norm=1)": lambda ps: Lamb(ps, lr=1e-4, max_grad_norm=1.0),
    }
    if args.device == "cuda":
        makers = {"AdamW(fused=True)": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True), **makers}
    results = {name: [] for name in makers}
    for _ in range(2):  # alternate to spread machine noise over all optimizers
        for name, make in makers.items():
            results[name] += time_steps(make, params, args.steps)
    base_name = next(iter(makers))
    base = statistics.median(results[base_name])
    print(f"| optimizer | median step ms | ratio to {base_name} |\n|---|---|---|")
    for name, times in results.items():
        median = statistics.median(times)
        print(f"| {name} | {1000 * median:.2f} | {median / base:.2f} |")


if __name__ == "__main__":
    main()
