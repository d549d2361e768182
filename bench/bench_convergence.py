"""Does packed training learn as unpacked training does, per sequence seen? (Krell et al., Fig. 3 left)

    python bench/bench_convergence.py [--quick] [--seeds 3] [--sequences N] [--device cpu|cuda]

Three variants over the demo corpus (`make demo-data`), each with several seeds, each
trained on the same number of sequences with the learning-rate schedule in sequences:

    unpacked               demo_out/unpacked_baseline, packing_adjustment none
    packed_same_sequences  demo_out/packed, same_sequences_per_step (GA / p: ~the same
                           sequences per optimizer step)
    packed_same_packs      demo_out/packed, same_packs_per_step (the same packs per step,
                           p times the sequences, betas^p, lr unchanged)

Everything else is configs/demo.yaml (bert-tiny, S=512, LAMB). Seed s sets both the
model's initialisation (training.seed) and the data order (data.shuffle_seed), so a
variant's spread is over both. Every run evaluates on the same held-out packs every
`--eval-every` sequences.

Writes OUT/convergence.png (eval MLM accuracy against sequences and training seconds,
mean +- one standard deviation over seeds), OUT/convergence.json (every curve) and
prints a table of the final eval MLM accuracy and loss per variant. Two variants are
compared by the difference of their mean final accuracy with Welch's t-interval:

    equivalent    the 90% interval lies inside +-margin (two one-sided tests at 5%, TOST)
    different     the 95% interval excludes 0
    inconclusive  neither (more seeds would tell)

The last line is `packed <acc> +- <sd> vs unpacked <acc> +- <sd> (<verdict>)` for
same_sequences_per_step, the default adjustment.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from packed_transformers.training.config import load_config  # noqa: E402

VARIANTS = {
    "unpacked": ("unpacked_baseline", "none"),
    "packed_same_sequences": ("packed", "same_sequences_per_step"),
    "packed_same_packs": ("packed", "same_packs_per_step"),
}
# Diagnostics (run only when named in --variants): where same_packs_per_step differs, is
# it its p times fewer optimizer steps at an unchanged learning rate (lr x p restores the
# distance LAMB moves the weights per sequence), or the beta^p heuristic (betas kept)?
DIAGNOSTICS = {
    "packed_same_packs_lr_x_p": ("packed", "same_packs_per_step"),
    "packed_same_packs_plain_betas": ("packed", "none"),
}
HEADLINE = ("packed_same_sequences", "unpacked")


def run_config(args, variant: str, seed: int) -> list[str]:
    """--set overrides of configs/demo.yaml for one run."""
    folder, adjustment = {**VARIANTS, **DIAGNOSTICS}[variant]
    warmup = max(1, int(args.sequences * args.warmup_fraction))
    lr = args.lr
    if variant == "packed_same_packs_lr_x_p":
        lr *= json.loads((args.data / folder / "metadata.json").read_text())["packing_factor"]
    return [
        f"data.train_dir={args.data / folder}",
        f"data.eval_dir={args.data / 'eval'}",
        f"optim.packing_adjustment={adjustment}",
        f"optim.lr={lr}",
        f"optim.warmup_samples={warmup}",
        f"optim.total_samples={args.sequences}",
        f"training.seed={seed}",
        f"data.shuffle_seed={seed}",
        f"training.max_samples={args.sequences}",
        "training.max_train_seconds=null",
        "training.max_steps=10000000",
        f"training.log_every_steps={args.log_every}",
        f"eval.every_samples={args.eval_every}",
        f"eval.max_sequences={args.eval_sequences}",
        f"execution.device={args.device}",
        f"execution.threads={args.threads}",
        f"training.precision={args.precision}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.mlperf=false",
    ]


def finished_with(output: Path, config: dict) -> bool:
    """Whether `output` holds a finished run (an `end` record) of exactly `config`."""
    import yaml

    saved, metrics = output / "config.yaml", output / "metrics.jsonl"
    if not (saved.is_file() and metrics.is_file()):
        return False
    same = yaml.safe_load(saved.read_text()) == yaml.safe_load(yaml.safe_dump(config, sort_keys=False))
    return same and any(json.loads(line)["kind"] == "end" for line in metrics.read_text().splitlines())


def train(args, variant: str, seed: int) -> Path | None:
    """One run in this process (the same code path as run_pretraining.py); its folder.
    With --reuse, a finished run of the same config is read instead of trained again
    (several processes may share a study: one per variant, then one to report)."""
    from packed_transformers.training.run import run

    output = args.out / "runs" / f"{variant}-seed{seed}"
    config = load_config(ROOT / "configs" / "demo.yaml", run_config(args, variant, seed))
    if (args.reuse or args.report_only) and finished_with(output, config):
        return output
    if args.report_only:
        return None
    if output.exists():
        shutil.rmtree(output)
    code = run(config, output, resume=False)
    if code != 0:
        raise SystemExit(f"error: {variant} seed {seed} exited with {code} ({output})")
    return output


def welch_interval(a: np.ndarray, b: np.ndarray, confidence: float) -> tuple[float, float, float]:
    """(mean(a) - mean(b), lower, upper): Welch's t-interval for the difference of means."""
    from scipy import stats

    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    diff = float(a.mean() - b.mean())
    se = math.sqrt(va + vb)
    if se == 0.0:
        return diff, diff, diff
    dof = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, dof)) * se
    return diff, diff - half, diff + half


def verdict(a: np.ndarray, b: np.ndarray, margin: float) -> tuple[str, tuple[float, float, float]]:
    """Both tests, both named: a difference can be real (the 95% interval excludes 0) and
    still smaller than the margin that matters (the 90% interval inside +-margin)."""
    diff, lo90, hi90 = welch_interval(a, b, 0.90)
    _, lo95, hi95 = welch_interval(a, b, 0.95)
    equivalent = -margin < lo90 and hi90 < margin
    different = lo95 > 0 or hi95 < 0
    if equivalent and different:
        text = f"different, but equivalent within +-{margin}"
    elif equivalent:
        text = f"equivalent within +-{margin}"
    elif different:
        text = "different"
    else:
        text = f"inconclusive at margin +-{margin}"
    return text, (diff, lo95, hi95)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="3 seeds x 2,000 sequences (~5 min on 2 cores)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per variant (default 3 quick, 5 full)")
    parser.add_argument(
        "--sequences", type=int, default=None, help="sequences per run (default 2,000 quick, 15,000 full)"
    )
    parser.add_argument("--eval-every", type=int, default=None, help="sequences between evaluations")
    parser.add_argument("--eval-sequences", type=int, default=400, help="held-out sequences per evaluation")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument(
        "--warmup-fraction", type=float, default=0.05, help="warm-up, a fraction of --sequences"
    )
    parser.add_argument(
        "--margin", type=float, default=0.01, help="equivalence margin, MLM accuracy (absolute)"
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=[*VARIANTS, *DIAGNOSTICS])
    parser.add_argument("--data", type=Path, default=ROOT / "demo_out", help="`make demo-data`'s folder")
    parser.add_argument("--out", type=Path, default=ROOT / "bench_out" / "convergence")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--reuse", action="store_true", help="read finished runs of the same config in OUT")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: report the seeds every variant finished in OUT",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        help="train nothing: report the curves of earlier studies' convergence.json (a variant's first file wins)",
    )
    args = parser.parse_args(argv)
    args.seeds = args.seeds or (3 if args.quick else 5)
    args.sequences = args.sequences or (2000 if args.quick else 15000)
    args.eval_every = args.eval_every or max(1, args.sequences // (6 if args.quick else 15))
    if args.seeds < 2:
        parser.error("--seeds must be >= 2 (a spread is needed to compare variants)")
    return args


def train_all(args) -> dict[str, list[dict]] | None:
    """{variant: [eval curve per seed]} over the seeds every variant finished."""
    from packed_transformers.components.curves import eval_curve

    curves: dict[str, list[dict]] = {v: [] for v in args.variants}
    for seed in range(args.seeds):  # seeds outermost: an interrupted study still compares variants
        seed_curves = {}
        for variant in args.variants:
            run_started = time.perf_counter()
            folder = train(args, variant, seed)
            if folder is None:
                break
            curve = seed_curves[variant] = eval_curve(folder)
            print(
                f"{variant} seed {seed}: eval MLM accuracy {curve['mlm_accuracy'][-1]:.4f} after "
                f"{int(curve['samples'][-1])} sequences ({time.perf_counter() - run_started:.0f} s)",
                flush=True,
            )
        if len(seed_curves) < len(args.variants):
            print(f"seed {seed}: not finished by every variant; left out", flush=True)
            continue
        for variant, curve in seed_curves.items():
            curves[variant].append(curve)
    return curves


def read_json_curves(files: list[Path]) -> tuple[dict[str, list[dict]], float, dict]:
    """Curves, unigram baseline and arguments of earlier studies (the first file's args)."""
    curves, baseline, first_args = {}, None, None
    for path in files:
        record = json.loads(path.read_text())
        first_args = first_args or record["args"]
        baseline = record["unigram_baseline"] if baseline is None else baseline
        for variant, runs in record["curves"].items():
            curves.setdefault(variant, [{k: np.array(v) for k, v in run.items()} for run in runs])
    return curves, baseline, first_args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from packed_transformers.components.curves import plot_curves, unigram_baseline

    started = time.perf_counter()
    if args.from_json:
        curves, baseline, earlier = read_json_curves(args.from_json)
        args.variants = [v for v in [*VARIANTS, *DIAGNOSTICS] if v in curves]
        args.sequences, args.device = earlier["sequences"], earlier["device"]
    else:
        if not (args.data / "packed" / "metadata.json").is_file():
            print(
                f"error: {args.data}/packed holds no packed dataset; run `make demo-data` first",
                file=sys.stderr,
            )
            return 2
        curves = train_all(args)
        _, baseline = unigram_baseline(args.data / "packed", args.data / "eval", args.eval_sequences)
    done = min(len(curves[v]) for v in args.variants)
    if done < 2:
        print(f"error: {done} seed(s) finished by every variant in {args.out}; 2 are needed", file=sys.stderr)
        return 2
    args.seeds = done
    curves = {v: curves[v][:done] for v in args.variants}
    final = {v: np.array([c["mlm_accuracy"][-1] for c in cs]) for v, cs in curves.items()}
    final_loss = {v: np.array([c["mlm_loss"][-1] for c in cs]) for v, cs in curves.items()}

    print(
        f"\n{args.seeds} seeds x {args.sequences} sequences, device {args.device}; unigram baseline {baseline:.4f}"
    )
    print("| variant | final eval MLM accuracy (mean +- sd) | final eval MLM loss | training s per run |")
    print("|---|---|---|---|")
    for v in args.variants:
        seconds = np.mean([c["train_seconds"][-1] for c in curves[v]])
        print(
            f"| {v} | {final[v].mean():.4f} +- {final[v].std(ddof=1):.4f} | "
            f"{final_loss[v].mean():.3f} +- {final_loss[v].std(ddof=1):.3f} | {seconds:.0f} |"
        )
    comparisons = {}
    for v in args.variants:
        if v != "unpacked" and "unpacked" in final:
            text, (diff, lo, hi) = verdict(final[v], final["unpacked"], args.margin)
            comparisons[v] = {"verdict": text, "difference": diff, "ci95": [lo, hi]}
            print(f"{v} - unpacked: {diff:+.4f} (95% CI {lo:+.4f} .. {hi:+.4f}): {text}")

    args.out.mkdir(parents=True, exist_ok=True)
    title = f"{args.seeds} seeds x {args.sequences} sequences per run, bert-tiny, S=512, {args.device}"
    plot_curves(
        {v: curves[v] for v in args.variants},
        baseline,
        args.out / "convergence.png",
        title,
        metrics=("mlm_accuracy", "mlm_loss"),
    )
    record = {
        "args": json.loads(json.dumps(vars(args), default=str)),
        "unigram_baseline": baseline,
        "comparisons": comparisons,
        "curves": {v: [{k: a.tolist() for k, a in c.items()} for c in cs] for v, cs in curves.items()},
    }
    from packed_transformers.common.files import atomic_path

    with atomic_path(args.out / "convergence.json") as tmp:
        tmp.write_text(json.dumps(record, indent=1))
    print(
        f"wrote {args.out / 'convergence.png'} and convergence.json ({time.perf_counter() - started:.0f} s)"
    )
    packed, unpacked = HEADLINE
    if packed in final and unpacked in final:
        p, u = final[packed], final[unpacked]
        print(
            f"packed {p.mean():.4f} +- {p.std(ddof=1):.4f} vs unpacked {u.mean():.4f} +- {u.std(ddof=1):.4f} "
            f"({comparisons[packed]['verdict']})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
