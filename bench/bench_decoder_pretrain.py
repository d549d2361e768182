"""Document-masked packs against the concatenated layout (MLPerf's reference), decoder
pretraining on CPU: the same model, documents, steps and schedule; tokens/s and eval loss.

    python bench/bench_decoder_pretrain.py --data work/lm [--steps 120] [--eval-every 24]
        [--eval-rows 32] [--out docs/decoder_pretraining]

--data: `packed pack-documents --layout both` output (its report.json gives the share of
causal attention pairs that cross a document in the concatenated layout). Each layout trains
with configs/pretrain_decoder_tiny.yaml for --steps steps (one 8192-token row a step) and
both are evaluated on the SAME rows, the documents layout's held-out rows (each document from
position 0, alone: the per-document log perplexity a user of the model meets), every
--eval-every steps. Throughput is the training log's tokens/s over the steps (evaluation
excluded). Writes OUT.png (eval loss against training tokens) and OUT.json, and prints the
table docs/decoder_pretraining.md holds.
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
sys.path.insert(0, str(REPO / "bench"))


def train(layout: str, args, output: Path) -> dict:
    argv = [sys.executable, str(REPO / "run_pretraining.py"), "--config", str(REPO / "configs/pretrain_decoder_tiny.yaml"),
            "--output-dir", str(output), "--set", f"data.train_dir={args.data / layout / 'train'}",
            "--set", f"data.eval_dir={args.data / 'documents' / 'eval'}", "--set", f"eval.rows={args.eval_rows}",
            "--set", f"training.max_steps={args.steps}", "--set", f"eval.every_samples={args.eval_every}",
            "--set", "eval.stop_at_target=false", "--set", "training.log_every_steps=1", "--set", "logging.mlperf=false"]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{layout}: run_pretraining.py failed\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    tokens = steps[-1]["tokens"]
    rate = sum(r["tokens_per_second"] for r in steps[2:]) / max(len(steps) - 2, 1)  # after two warm-up steps
    return {"layout": layout, "tokens": tokens, "tokens_per_second": rate, "wall_seconds": time.perf_counter() - started,
            "eval": [(r["tokens"], r["log_perplexity"]) for r in evals],
            "final_train_loss": steps[-1]["loss"]}  # fmt: skip


def cross_evaluation(model_folder: Path, eval_dir: Path, rows: int) -> float:
    """Log perplexity of a trained run's final weights over the first `rows` rows of another
    layout's evaluation set (the concatenated rows: each document after the ones before it)."""
    import torch

    from packed_transformers.components.decoder_data import evaluation_batches
    from packed_transformers.model.families import next_token_targets
    from packed_transformers.model.family_model import PackedFamilyModel
    from packed_transformers.packs.lm_rows.store import RowStore

    model = PackedFamilyModel.from_pretrained(model_folder, "causal_lm").eval()
    store = RowStore.open(eval_dir, check_sha256=False)
    total = count = 0.0
    with torch.no_grad():
        for batch in evaluation_batches(store, rows, 0, 1, 1):
            out = model(**batch, shift_labels=next_token_targets(batch["input_ids"], batch["sequence_ids"]))
            total, count = total + float(out["token_loss_sum"]), count + float(out["token_count"])
    return total / count


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--eval-every", type=int, default=24)
    parser.add_argument("--eval-rows", type=int, default=32)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "decoder_pretraining")
    parser.add_argument("--scratch", type=Path, default=REPO / "work" / "bench_decoder_pretrain")
    args = parser.parse_args()
    import machine

    report = json.loads((args.data / "report.json").read_text())
    results = {}
    for layout in ("documents", "concatenated"):
        output = args.scratch / layout
        if output.exists():
            import shutil

            shutil.rmtree(output)
        results[layout] = train(layout, args, output)
    for layout, result in results.items():  # both models on the concatenated evaluation rows too
        final = sorted((args.scratch / layout / "checkpoints").glob("step-*"))[-1] / "model"
        result["eval_on_concatenated_rows"] = cross_evaluation(
            final, args.data / "concatenated" / "eval", args.eval_rows
        )
    docs, flat = results["documents"], results["concatenated"]
    info = machine.description()
    summary = {
        "machine": info,
        "data": {k: report["layouts"][k]["train"] for k in ("documents", "concatenated")},
        "results": results,
        "speedup_tokens_per_second": docs["tokens_per_second"] / flat["tokens_per_second"],
        "command": " ".join(sys.argv),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, result in results.items():
        tokens, values = zip(*result["eval"])
        ax.plot(
            [t / 1e6 for t in tokens],
            values,
            marker="o",
            label=f"{name} ({result['tokens_per_second']:.0f} tokens/s)",
        )
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("eval log perplexity (documents alone)")
    ax.set_title("Decoder pretraining, rows of 8192: document-masked vs concatenated", fontsize=9)
    ax.legend()
    fig.text(0.01, 0.01, machine.line(info), fontsize=6)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print("| layout trained on | train tokens | tokens/s | eval log perplexity, documents alone | "
          "eval log perplexity, concatenated rows | training pairs crossing a document |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for name, result in results.items():
        crossing = report["layouts"][name]["train"]["crossing_attention_pair_share"]
        print(f"| {name} | {result['tokens']:,} | {result['tokens_per_second']:,.0f} | {result['eval'][-1][1]:.4f} | "
              f"{result['eval_on_concatenated_rows']:.4f} | {crossing:.1%} |")  # fmt: skip
    print(
        f"documents / concatenated tokens/s: {summary['speedup_tokens_per_second']:.2f}x; {machine.line(info)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
