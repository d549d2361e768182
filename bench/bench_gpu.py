"""BERT-Large phase-2 training throughput on one GPU: packed against padded, per attention
backend, eager / torch.compile / torch.compile with CUDA graphs, in one run.

    python bench/bench_gpu.py [--rows 32] [--steps 10] [--configs varlen:compile dense:eager ...]
    python bench/bench_gpu.py --dry-run      # CPU: checks the plan and the FLOP count, no GPU

Data: synthetic shards' statistics: packs drawn from the Wikipedia-512 length histogram
(LPFHP, K=3, M=76 slots per pack, 15% of each sequence masked), S=512. "padded" feeds the
same number of rows with one sequence per row (the unpacked baseline, same model, same
backend). Each step is the application's own step (training.backends.torch_engine.
train_step: host batches copied to the GPU, bf16 autocast, backward, LAMB) on one
micro-batch of `--rows` rows.

Reported per configuration: real sequences/s; model FLOPs utilisation from the real
tokens (matmuls 6 x 12 H^2 L per token, attention 12 l^2 H L per sequence, MLM head on
masked tokens; divided by the H200's 989 TFLOP/s dense bf16 peak); peak memory; and
packed / padded against the sampled packing factor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import HIST, sample_rows  # noqa: E402

from model import PackedBertForPreTraining, bert_config  # noqa: E402
from optim import Lamb  # noqa: E402
from packing import Histogram, pack  # noqa: E402
from training.backends.torch_engine import train_step  # noqa: E402
from training.observe import MetricSums  # noqa: E402

PEAK_BF16_FLOPS = 989e12  # H200 SXM, dense bf16 tensor-core peak
S, K, M = 512, 3, 76
DEFAULT_CONFIGS = [
    "dense:eager",
    "sdpa:eager",
    "varlen:eager",
    "sdpa:compile",
    "flex:compile",
    "varlen:compile",
    "varlen:cudagraphs",
]


def model_flops(batch: dict, config) -> float:
    """Training FLOPs (forward + backward = 3 x forward) of the real tokens of a batch."""
    h, layers, v, inter = (
        config.hidden_size,
        config.num_hidden_layers,
        config.vocab_size,
        config.intermediate_size,
    )
    ids = batch["sequence_ids"].long()
    k = int(batch["next_sentence_weights"].shape[1])
    lengths = torch.stack([(ids == j).sum(1) for j in range(1, k + 1)], 1).double()  # [B, K]
    tokens = float(lengths.sum())
    squares = float((lengths**2).sum())
    masked = float((batch["masked_lm_weights"] > 0).sum())
    sequences = float(batch["next_sentence_weights"].sum())
    matmul = 2 * (4 * h * h + 2 * h * inter) * layers * tokens  # q, k, v, out; FFN in and out
    attention = 4 * h * squares * layers  # QK^T and PV per sequence
    heads = 2 * (h * h + h * v) * masked + 2 * (h * h + 2 * h) * sequences
    return 3 * (matmul + attention + heads)


def make_batches(rows: int, count: int, packed: bool, seed: int, vocab: int) -> list[dict]:
    plan = pack(Histogram.from_json_file(HIST), "lpfhp", K)
    rng = np.random.default_rng(seed)
    batches = [sample_rows(rng, plan, rows, S, K, M, vocab, packed) for _ in range(count)]
    return [{n: t.pin_memory() if torch.cuda.is_available() else t for n, t in b.items()} for b in batches]


def measure(backend: str, mode: str, batches: list[dict], steps: int, preset: str) -> dict:
    device = torch.device("cuda")
    config = bert_config(preset, attention_backend=backend)
    if backend == "flex":  # FlexAttention has no attention dropout
        config.attention_probs_dropout_prob = 0.0
    torch.manual_seed(0)
    model = PackedBertForPreTraining(config).to(device).train()
    optimizer = Lamb(model.parameters(), lr=1e-4, betas=(0.6, 0.85), weight_decay=0.01, max_grad_norm=1.0)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    step_model = model
    if mode == "compile":
        step_model = torch.compile(model)
    elif mode == "cudagraphs":
        step_model = torch.compile(model, mode="reduce-overhead")

    def one(batch):
        return train_step(
            step_model, optimizer, scaler, [batch], 1e-4, "bf16", device, 1, "per_token", MetricSums()
        )

    torch.cuda.reset_peak_memory_stats()
    compile_start = time.perf_counter()
    for i in range(3):  # warm-up (and compilation)
        one(batches[i % len(batches)])
    torch.cuda.synchronize()
    warmup = time.perf_counter() - compile_start
    times, sequences, flops = [], 0, 0.0
    for i in range(steps):
        batch = batches[i % len(batches)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        one(batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        sequences += int(batch["next_sentence_weights"].sum())
        flops += model_flops(batch, config)
    seconds = sum(times)
    result = {
        "sequences_per_second": sequences / seconds,
        "median_step_ms": 1000 * statistics.median(times),
        "mfu": flops / seconds / PEAK_BF16_FLOPS,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "warmup_seconds": warmup,
    }
    optimizer.state.clear()  # free the GPU before the next configuration
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rows", type=int, default=32, help="rows (packs or padded sequences) per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--preset", default="bert-large")
    parser.add_argument(
        "--configs", nargs="+", default=DEFAULT_CONFIGS, help="backend:eager|compile|cudagraphs"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: build the batches, count FLOPs, exit")
    args = parser.parse_args()
    vocab = bert_config(args.preset).vocab_size
    kinds = {
        "packed": make_batches(args.rows, 4, True, 0, vocab),
        "padded": make_batches(args.rows, 4, False, 1, vocab),
    }
    factor = statistics.mean(float(b["next_sentence_weights"].sum()) / args.rows for b in kinds["packed"])
    for backend_mode in args.configs:
        backend, _, mode = backend_mode.partition(":")
        if mode not in ("eager", "compile", "cudagraphs"):
            raise SystemExit(f"--configs {backend_mode!r}: expected backend:eager|compile|cudagraphs")
    if args.dry_run:
        config = bert_config(args.preset)
        for kind, batches in kinds.items():
            tflop = statistics.mean(model_flops(b, config) for b in batches) / 1e12
            print(f"{kind}: {args.rows} rows, {tflop:.2f} model TFLOP per step")
        print(f"sampled packing factor {factor:.3f}")
        return
    if not torch.cuda.is_available():
        print(
            f"error: bench_gpu.py needs a CUDA GPU, and torch {torch.__version__} sees none here (a CPU "
            "build, or no device); install the CUDA wheel (README: Install) on a GPU machine, or run "
            "--dry-run to plan the batches without one",
            file=sys.stderr,
        )
        raise SystemExit(2)
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; {args.preset} "
        f"S={S} bf16, {args.rows} rows per step, {args.steps} timed steps; sampled packing factor {factor:.3f}"
    )
    print(
        "| attention | mode | packed seq/s | padded seq/s | packed/padded | / packing factor | packed MFU | padded MFU | peak GiB (packed) | warm-up s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for backend_mode in args.configs:
        backend, _, mode = backend_mode.partition(":")
        row = {"backend": backend, "mode": mode}
        for kind, batches in kinds.items():
            try:
                row[kind] = measure(backend, mode, batches, args.steps, args.preset)
            except Exception as err:  # a configuration torch cannot run: say so, go on
                row[kind] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"}
        results.append(row)
        p, q = row["packed"], row["padded"]
        if "error" in p or "error" in q:
            print(f"| {backend} | {mode} | failed: {p.get('error') or q.get('error')} |")
            continue
        ratio = p["sequences_per_second"] / q["sequences_per_second"]
        print(
            f"| {backend} | {mode} | {p['sequences_per_second']:.0f} | {q['sequences_per_second']:.0f} | "
            f"{ratio:.2f} | {ratio / factor:.2f} | {p['mfu']:.1%} | {q['mfu']:.1%} | "
            f"{p['peak_memory_gib']:.1f} | {p['warmup_seconds']:.0f} |",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps({"packing_factor": factor, "results": results}, indent=1))


if __name__ == "__main__":
    main()
