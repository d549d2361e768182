"""BERT-Large phase-2 training throughput on one GPU: packed against padded, per attention
backend, eager / torch.compile / torch.compile with CUDA graphs, in one run.

    python bench/bench_gpu.py [--rows 32] [--steps 10] [--configs varlen:compile dense:eager ...]
    python bench/bench_gpu.py --all --out DIR   # every GPU measurement in one go (below)
    python bench/bench_gpu.py --dry-run [--all] # CPU: the plan and the FLOP count, no GPU

--all runs, in this order, writing DIR/gpu.json (a list of runs: date, commit, device, model,
what, sequences_per_second, mfu, notes) and DIR/gpu.md (the tables) after every part, so a
run cut short keeps what it measured:
  lamb       one optimizer step over the BERT-Large parameter set: AdamW(fused=True),
             Lamb (foreach), Lamb(compiled=True)
  step       the training step, packed and padded on the same compiled model, for each of
             PLAN's setups (attention, mode, rows, LAMB kind, fp8)
  profile    the first setup's packed step under torch.profiler, GPU time by operator class
             (matmul, attention, elementwise/norm, optimizer, copies) and the host's share
  fp8        the per-step loss of the fp8 setup against its bf16 twin (same init, same packs)

Data: synthetic shards' statistics: packs drawn from the Wikipedia-512 length histogram
(LPFHP, K=3, M=76 slots per pack, 15% of each sequence masked), S=512. "padded" feeds the
same number of rows with one sequence per row (the unpacked baseline, same model, same
backend). Each step is the application's own step (engines.torch_engine.
TorchStep.step: host batches copied to the GPU, bf16 autocast, backward, LAMB) on one
micro-batch of `--rows` rows.

Reported per configuration: real sequences/s; model FLOPs utilisation from the real
tokens (matmuls 6 x 12 H^2 L per token, attention 12 l^2 H L per sequence, MLM head on
masked tokens; divided by the H200's 989 TFLOP/s dense bf16 peak); peak memory; and
packed / padded against the sampled packing factor.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lamb import bert_large_shapes, time_steps  # noqa: E402
from bench_model import HIST, sample_rows  # noqa: E402

from packed_transformers.components.observe import MetricSums, summarize  # noqa: E402
from packed_transformers.engines.engine import PER_TOKEN  # noqa: E402
from packed_transformers.engines.torch_engine import StepSettings, TorchStep  # noqa: E402
from packed_transformers.model import PackedBertForPreTraining, bert_config  # noqa: E402
from packed_transformers.optim import Lamb  # noqa: E402
from packed_transformers.packing import Histogram, pack  # noqa: E402

DEVICE = torch.device("cuda")  # --dry-run --all rehearses on the CPU with a tiny model
PEAK_BF16_FLOPS = 989e12  # H100 / H200 SXM, dense bf16 tensor-core peak (the same chip)
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


@dataclasses.dataclass(frozen=True)
class Setup:
    """One measured training configuration."""

    backend: str  # attention backend: dense | sdpa | flex | varlen
    mode: str  # eager | compile | cudagraphs (torch.compile mode="reduce-overhead")
    rows: int  # packs (or padded sequences) per step
    lamb: str = "foreach"  # foreach | compiled (Lamb(compiled=True))
    fp8: bool = False  # torchao float8 training for the encoder's Linear layers

    @property
    def name(self) -> str:
        extra = ("+compiled-lamb" if self.lamb == "compiled" else "") + ("+fp8" if self.fp8 else "")
        return f"{self.backend}:{self.mode} rows={self.rows}{extra}"


# --all: what was expected to matter most first (a run cut short keeps the first rows).
PLAN = [
    Setup("varlen", "compile", 32),  # the last H200 run's best configuration, as the anchor
    Setup("varlen", "compile", 64, "compiled"),
    Setup("varlen", "compile", 64, "compiled", fp8=True),
    Setup("varlen", "cudagraphs", 64, "compiled"),
    Setup("sdpa", "compile", 64, "compiled"),
]


def parse_setup(text: str) -> Setup:
    """backend:mode:rows[:compiled-lamb][:fp8], e.g. varlen:compile:64:fp8."""
    parts = text.split(":")
    if len(parts) < 3 or not parts[2].isdigit() or not set(parts[3:]) <= {"compiled-lamb", "fp8"}:
        raise SystemExit(f"--setups {text!r}: expected backend:mode:rows[:compiled-lamb][:fp8]")
    lamb = "compiled" if "compiled-lamb" in parts[3:] else "foreach"
    return Setup(parts[0], parts[1], int(parts[2]), lamb, "fp8" in parts[3:])


def fp8_linear_filter(module, fqn: str) -> bool:
    """Float8 matmuls (torch._scaled_mm) need every dimension divisible by 16, the token count
    too (it is the contracted dimension of the weight gradient). Only the encoder's Linear
    layers qualify: they see rows x S tokens (S a multiple of 16). The pooler sees rows x K
    [CLS] tokens and the MLM transform rows x M masked slots, counts that vary with the batch
    (an odd number of rows failed in the backward on the H100); the NSP head has 2 outputs and
    the MLM decoder's vocabulary of 30,522 is not a multiple of 16."""
    return (
        isinstance(module, torch.nn.Linear)
        and ".encoder." in f".{fqn}"
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def build(setup: Setup, preset: str):
    device = DEVICE
    config = bert_config(preset, attention_backend=setup.backend)
    if setup.backend == "flex":  # FlexAttention has no attention dropout
        config.attention_probs_dropout_prob = 0.0
    torch.manual_seed(0)
    model = PackedBertForPreTraining(config).to(device).train()
    if setup.fp8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=fp8_linear_filter)
    optimizer = Lamb(
        model.parameters(),
        lr=1e-4,
        betas=(0.6, 0.85),
        weight_decay=0.01,
        max_grad_norm=1.0,
        compiled=setup.lamb == "compiled",
    )
    step_model = model
    if setup.mode == "compile":
        step_model = torch.compile(model)
    elif setup.mode == "cudagraphs":
        step_model = torch.compile(model, mode="reduce-overhead")
    scaler = torch.amp.GradScaler(DEVICE.type, enabled=False)

    torch_step = TorchStep(model, optimizer, step_model, StepSettings(device, "bf16"), scaler=scaler)

    def one(batch) -> MetricSums:
        sums = MetricSums()
        for vector in torch_step.step([batch], PER_TOKEN, 1e-4).kept:
            sums.add_vector(vector)
        return sums

    return config, one, optimizer


def time_kind(one, config, batches: list[dict], steps: int) -> dict:
    """Warm-up (and compilation) steps, then `steps` timed steps; per-step losses kept."""
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    compile_start = time.perf_counter()
    step_sums = [one(batches[i % len(batches)]) for i in range(3)]
    sync()
    warmup = time.perf_counter() - compile_start
    times, sequences, flops = [], 0, 0.0
    for i in range(steps):
        batch = batches[(i + 3) % len(batches)]
        sync()
        start = time.perf_counter()
        step_sums.append(one(batch))
        sync()
        times.append(time.perf_counter() - start)
        sequences += int(batch["next_sentence_weights"].sum())
        flops += model_flops(batch, config)
    seconds = sum(times)
    losses = [summarize(s.reduce(lambda t: t))["loss"] for s in step_sums]
    return {
        "sequences_per_second": sequences / seconds,
        "median_step_ms": 1000 * statistics.median(times),
        "mfu": flops / seconds / PEAK_BF16_FLOPS,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE.type == "cuda" else 0.0,
        "warmup_seconds": warmup,
        "losses": losses,
    }


def measure_setup(setup: Setup, kinds: dict[str, list[dict]], steps: int, preset: str, profile=False) -> dict:
    """Packed, then padded, through one model and one compilation (the shapes are the same);
    with `profile`, the packed step is then profiled on the same warm model."""
    config, one, optimizer = build(setup, preset)
    row = {"setup": dataclasses.asdict(setup), "name": setup.name}
    for kind, batches in kinds.items():
        row[kind] = time_kind(one, config, batches, steps)
        if profile and kind == "packed":
            row["profile"] = profile_steps(one, batches)
    optimizer.state.clear()  # free the GPU before the next configuration
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    return row


def measure(backend: str, mode: str, batches: list[dict], steps: int, preset: str) -> dict:
    """One kind of batches through a fresh model (the --configs table)."""
    config, one, optimizer = build(Setup(backend, mode, int(batches[0]["input_ids"].shape[0])), preset)
    result = time_kind(one, config, batches, steps)
    optimizer.state.clear()
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return result


# Kernel names by operator class, first match wins (cuBLAS / CUTLASS / nvjet GEMMs, flash
# attention, torch's foreach and the compiled optimizer, copies; the rest is elementwise,
# normalisation, softmax, dropout and reductions).
OPERATOR_CLASSES = [
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    (
        "matmul",
        ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "_mm_", "tem_fused_mm", "addmm", "bmm"),
    ),
    ("optimizer", ("foreach", "multi_tensor", "lamb")),
    ("copies", ("memcpy", "memset")),
]
# Ranges the profiler also reports on the GPU timeline (record_function annotations, compiled
# regions): they overlap the kernels inside them and are not counted.
ANNOTATIONS = ("Optimizer.", "Torch-Compiled Region", "CompiledFunction", "autograd::", "ProfilerStep", "## ")


def operator_class(kernel: str) -> str:
    name = kernel.lower()
    for label, needles in OPERATOR_CLASSES:
        if any(n in name for n in needles):
            return label
    return "elementwise/norm"


def profile_steps(one, batches: list[dict], steps: int = 3) -> dict:
    """GPU time by operator class over `steps` steps of an already warm `one`, and the
    host's share (wall time minus the kernels' time: launch gaps, syncs, Python)."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for i in range(steps):
            one(batches[i % len(batches)])
        sync()
        wall = time.perf_counter() - start
    by_class: dict[str, float] = {}
    top: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA and DEVICE.type == "cuda":
            continue
        if DEVICE.type == "cuda" and event.name.startswith(ANNOTATIONS):
            continue
        if DEVICE.type == "cpu" and event.cpu_parent is not None:
            continue  # on the CPU rehearsal, top-level operators stand in for kernels
        micros = event.device_time_total if DEVICE.type == "cuda" else event.cpu_time_total
        label = operator_class(event.name)
        by_class[label] = by_class.get(label, 0.0) + micros / 1e6
        top[event.name] = top.get(event.name, 0.0) + micros / 1e6
    kernels = sum(by_class.values())
    return {
        "wall_ms_per_step": 1000 * wall / steps,
        "ms_per_step": {k: 1000 * v / steps for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "host_and_gaps_ms_per_step": 1000 * max(wall - kernels, 0.0) / steps,
        "top_kernels_ms_per_step": {
            k[:90]: 1000 * v / steps for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]
        },
    }


def lamb_microbench(steps: int = 10) -> list[dict]:
    """One optimizer step over the BERT-Large parameter set: fused AdamW, Lamb, Lamb compiled."""
    torch.manual_seed(0)
    shapes = (
        bert_large_shapes()
        if DEVICE.type == "cuda"
        else bert_large_shapes(vocab=1000, hidden=64, layers=2, intermediate=128)
    )
    params = [torch.nn.Parameter(torch.randn(s, device=DEVICE) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    makers = {
        "AdamW(fused=True)": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=DEVICE.type == "cuda"),
        "Lamb (foreach)": lambda ps: Lamb(ps, lr=1e-4, max_grad_norm=1.0),
        "Lamb(compiled=True)": lambda ps: Lamb(ps, lr=1e-4, max_grad_norm=1.0, compiled=True),
    }
    results = []
    for name, make in makers.items():
        started = time.perf_counter()
        times = time_steps(make, params, steps, warmup_steps=2)  # state allocation and compilation untimed
        warmup = time.perf_counter() - started - sum(times)
        results.append(
            {"optimizer": name, "median_step_ms": 1000 * statistics.median(times), "warmup_seconds": warmup}
        )
    base = results[0]["median_step_ms"]
    for r in results:
        r["ratio_to_fused_adamw"] = r["median_step_ms"] / base
    return results


def provenance(preset: str) -> dict:
    """Date, commit (BENCH_COMMIT where the tree travels without .git), device, software."""
    import os

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        commit = ""
    import transformers

    return {
        "date": datetime.date.today().isoformat(),
        "commit": os.environ.get("BENCH_COMMIT") or commit or "unknown",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (dry run)",
        "software": f"torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}, "
        f"Python {sys.version.split()[0]}",
        "model": preset,
    }


def run_all(args, kinds: dict, factor: float) -> None:
    """Every GPU measurement in one go; DIR/gpu.json and DIR/gpu.md rewritten after each part."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    base = provenance(args.preset)
    runs: list[dict] = []
    tables: list[str] = [
        f"# bench_gpu.py --all: {base['device']}, {base['software']}, commit {base['commit']}, {base['date']}"
    ]

    def save():
        (out / "gpu.json").write_text(json.dumps(runs, indent=1))
        (out / "gpu.md").write_text("\n\n".join(tables) + "\n")

    def part(title, fn):
        try:
            fn()
        except Exception as err:  # one part failing must not cost the others' device time
            message = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
            tables.append(f"## {title}: failed\n\n{message}")
            runs.append(
                {
                    **base,
                    "what": title,
                    "sequences_per_second": None,
                    "mfu": None,
                    "notes": f"failed: {message}",
                }
            )
            print(f"{title}: failed: {message}", flush=True)
        save()

    def lamb_part():
        rows = lamb_microbench()
        lines = [
            "## LAMB step (BERT-Large parameter set, 336 M in 398 tensors)",
            "",
            "| optimizer | median step ms | ratio to AdamW(fused=True) | warm-up s |",
            "|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['optimizer']} | {r['median_step_ms']:.2f} | {r['ratio_to_fused_adamw']:.2f} | {r['warmup_seconds']:.1f} |"
            )
            runs.append(
                {
                    **base,
                    "what": f"optimizer step: {r['optimizer']}",
                    "sequences_per_second": None,
                    "mfu": None,
                    "notes": json.dumps(r),
                }
            )
        tables.append("\n".join(lines))
        print(tables[-1], flush=True)

    step_rows: dict[str, dict] = {}
    by_rows: dict[int, tuple[dict, float]] = {args.rows: (kinds, factor)}

    def batches_for(rows: int) -> tuple[dict, float]:
        if rows not in by_rows:
            vocab = bert_config(args.preset).vocab_size
            made = {
                "packed": make_batches(rows, 4, True, 0, vocab),
                "padded": make_batches(rows, 4, False, 1, vocab),
            }
            by_rows[rows] = (
                made,
                statistics.mean(float(b["next_sentence_weights"].sum()) / rows for b in made["packed"]),
            )
        return by_rows[rows]

    def step_part(setup: Setup):
        kinds, factor = batches_for(setup.rows)
        row = measure_setup(setup, kinds, args.steps, args.preset, profile=setup == PLAN[0])
        step_rows[setup.name] = row
        p, q = row["packed"], row["padded"]
        ratio = p["sequences_per_second"] / q["sequences_per_second"]
        for kind in ("packed", "padded"):
            r = row[kind]
            runs.append(
                {
                    **base,
                    "what": f"pretraining step, {kind}: {setup.name}",
                    "sequences_per_second": r["sequences_per_second"],
                    "mfu": r["mfu"],
                    "notes": json.dumps(
                        {k: v for k, v in r.items() if k != "losses"}
                        | {"packing_factor": factor, "packed_over_padded": ratio}
                    ),
                }
            )
        header = "## Training step (S=512, bf16 autocast, LAMB, the application's TorchStep.step)\n\n| setup | packed seq/s | padded seq/s | packed/padded | / packing factor | packed MFU | padded MFU | step ms (packed) | peak GiB | warm-up s |\n|---|---|---|---|---|---|---|---|---|---|"
        if not any(t.startswith("## Training step") for t in tables):
            tables.append(header)
        index = next(i for i, t in enumerate(tables) if t.startswith("## Training step"))
        tables[index] += (
            f"\n| {setup.name} | {p['sequences_per_second']:.0f} | {q['sequences_per_second']:.0f} | {ratio:.2f} | "
            f"{ratio / factor:.2f} | {p['mfu']:.1%} | {q['mfu']:.1%} | {p['median_step_ms']:.1f} | "
            f"{p['peak_memory_gib']:.1f} | {p['warmup_seconds']:.0f} |"
        )
        print(tables[index].splitlines()[-1], flush=True)

    def profile_part():
        result = step_rows[PLAN[0].name]["profile"]
        wall = result["wall_ms_per_step"]
        lines = [
            f"## Profile: {PLAN[0].name}, packed, {wall:.1f} ms per step (wall, under the profiler)",
            "",
            "| class | GPU ms per step | share of wall |",
            "|---|---|---|",
        ]
        for label, ms in result["ms_per_step"].items():
            lines.append(f"| {label} | {ms:.1f} | {ms / wall:.0%} |")
        host = result["host_and_gaps_ms_per_step"]
        lines.append(f"| host and gaps (wall - kernels) | {host:.1f} | {host / wall:.0%} |")
        lines += [
            "",
            "Top kernels (ms per step): "
            + "; ".join(f"`{k}` {v:.1f}" for k, v in result["top_kernels_ms_per_step"].items()),
        ]
        runs.append(
            {
                **base,
                "what": "profile by operator class",
                "sequences_per_second": None,
                "mfu": None,
                "notes": json.dumps(result),
            }
        )
        tables.append("\n".join(lines))
        print(tables[-1], flush=True)

    def fp8_part():
        pairs = [(s, dataclasses.replace(s, fp8=False)) for s in PLAN if s.fp8]
        for fp8, twin in pairs:
            if fp8.name not in step_rows or twin.name not in step_rows:
                continue
            a, b = step_rows[fp8.name]["packed"]["losses"], step_rows[twin.name]["packed"]["losses"]
            worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
            lines = [
                f"## FP8 against bf16: per-step packed loss, same init and packs ({len(a)} steps)",
                "",
                f"| step | {twin.name} | {fp8.name} |",
                "|---|---|---|",
            ]
            lines += [f"| {i + 1} | {y:.4f} | {x:.4f} |" for i, (x, y) in enumerate(zip(a, b))]
            lines.append(
                f"\nlargest relative loss difference {worst:.2%} (dropout draws differ between the runs)"
            )
            runs.append(
                {
                    **base,
                    "what": "fp8 vs bf16 loss",
                    "sequences_per_second": None,
                    "mfu": None,
                    "notes": json.dumps({"bf16": b, "fp8": a, "max_relative_difference": worst}),
                }
            )
            tables.append("\n".join(lines))
            print(tables[-1], flush=True)

    torch._dynamo.config.cache_size_limit = 64  # one model per setup: no recompilation limit hit
    if not args.skip_lamb:
        part("lamb", lamb_part)
    for setup in PLAN:
        part(f"step {setup.name}", lambda setup=setup: step_part(setup))
        if setup == PLAN[0] and setup.name in step_rows:
            part("profile", profile_part)
    part("fp8", fp8_part)


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
    parser.add_argument("--all", action="store_true", help="every GPU measurement (the docstring's list)")
    parser.add_argument(
        "--setups",
        nargs="+",
        help="--all: these setups instead of PLAN, as backend:mode:rows[:compiled-lamb][:fp8]",
    )
    parser.add_argument("--skip-lamb", action="store_true", help="--all: no optimizer microbenchmark")
    parser.add_argument(
        "--out", type=Path, default=Path("bench_out/gpu"), help="--all: gpu.json and gpu.md here"
    )
    parser.add_argument("--dry-run", action="store_true", help="no GPU: build the batches, count FLOPs, exit")
    args = parser.parse_args()
    if args.setups:
        PLAN[:] = [parse_setup(text) for text in args.setups]
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
        if args.all:  # the whole --all path on the CPU with a tiny model: every part but its speed
            global DEVICE
            DEVICE = torch.device("cpu")
            args.preset, args.steps = "bert-tiny", 1
            PLAN[:] = [
                dataclasses.replace(s, rows=2, mode="eager" if s.mode == "cudagraphs" else s.mode)
                for s in PLAN
            ]
            rehearsal = {
                kind: [{n: t[:2] for n, t in b.items()} for b in batches] for kind, batches in kinds.items()
            }
            run_all(args, rehearsal, factor)
        return
    if not torch.cuda.is_available():
        print(
            f"error: bench_gpu.py needs a CUDA GPU, and torch {torch.__version__} sees none here (a CPU "
            "build, or no device); install the CUDA wheel (README: Install) on a GPU machine, or run "
            "--dry-run to plan the batches without one",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if args.all:
        run_all(args, kinds, factor)
        return
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
