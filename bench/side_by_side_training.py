"""The three training jobs of two checkouts, whole processes, interleaved: a refactor's check
that training did not get slower or compute anything else (issue 81: "make bench's training
rows no slower, side by side with today's").

    git worktree add /tmp/old 67283d1
    python bench/side_by_side_training.py --old /tmp/old [--rounds 3]

Each tree runs its own command with PYTHONPATH set to it (move .venv's editable-install .pth
aside first: its finder maps the package to this checkout), in an order that alternates
every round:
- BERT pretraining: `run_pretraining.py --config configs/demo.yaml`, synthetic packs
  (`data.synthetic: true`), --bert-steps steps; its figure is the end record's train_seconds;
- decoder pretraining: configs/pretrain_decoder_tiny.yaml on document-masked rows of 2,048
  tokens written here from random documents (the same rows for both trees), --decoder-steps
  steps; its figure is the process's wall time less nothing (no evaluation, no checkpoint
  but the last);
- fine-tuning: configs/finetune_bbc.yaml (MiniLM-L6 on BBC News, packed batching), one
  epoch; its figure is summary.json's training examples/s (optimizer steps only);
- short-text multi-label fine-tuning (`multilabel`: many small steps, where a step's own
  overhead shows): configs/finetune_own.yaml on BBC headlines' first 8 words, each labelled
  with its topic and, where it holds a digit, "number" (data.multi_label), batches of 8
  examples of at most 32 tokens, one epoch; its figure as fine-tuning's;
- contrastive training (`contrastive`): configs/finetune_embedding.yaml (MiniLM-L6, in-batch
  negatives) on the BBC pairs `packed embedding-texts --kind pairs` writes (the new tree's command,
  once), one epoch; its figure as fine-tuning's, its check the held-out pairs' in-batch loss.
The final losses (BERT, decoder) and the validation scores (fine-tuning) must agree between
the trees: the same computation (`same_result`: equal within 1e-4 relative, which a change
in float summation order keeps; `identical`: bit for bit). Prints one JSON object (medians
and every round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[1]
FINETUNING = ("finetune", "multilabel", "contrastive")  # figure: summary.json's training examples/s


def decoder_rows(folder: Path) -> Path:
    """Document-masked rows of 2,048 tokens from random documents (vocabulary 512)."""
    sys.path.insert(0, str(HERE))
    from packed_transformers.packs.lm_rows.layouts import document_rows
    from packed_transformers.packs.lm_rows.store import write_rows

    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 1500, 400)
    tokens = [rng.integers(1, 512, n).astype(np.int32) for n in lengths]
    write_rows(
        folder, document_rows(tokens, 2048, depth=None), 512, 0, {"role": "train", "documents_in": 400}
    )
    return folder


def command(job: str, tree: Path, out: Path, args, rows: Path) -> list[str]:
    sets = {
        "bert": ["data.synthetic=true", "data.eval_dir=null", "logging.mlperf=false", "data.max_sequences_per_pack=3", f"training.max_steps={args.bert_steps}", "logging.progress=false",
                 "logging.tensorboard=false", "training.max_train_seconds=null", "eval.every_samples=1000000000",
                 "eval.at_end=false"],
        "decoder": [f"data.train_dir={rows}", "data.eval_dir=null", "data.max_sequence_length=2048",
                    f"training.max_steps={args.decoder_steps}", "training.log_every_steps=1",
                    "logging.tensorboard=false", "model.vocab_size=512"],
        "finetune": ["training.epochs=1", "training.progress=false"],
        "multilabel": [f"data.train_file={rows}", "data.multi_label=true", "data.max_sequence_length=32",
                       "batching.batch_size=8", "training.epochs=1", "training.progress=false"],
        "contrastive": [f"data.train_file={rows}", "training.epochs=1", "training.progress=false"],
    }[job]  # fmt: skip
    extra = [a for s in sets for a in ("--set", s)]
    if job in FINETUNING:
        config = tree / "configs" / {"finetune": "finetune_bbc.yaml", "multilabel": "finetune_own.yaml",
                                     "contrastive": "finetune_embedding.yaml"}[job]  # fmt: skip
        return [sys.executable, "-m", "packed_transformers.finetune.train", "--config", str(config),
                "--output-dir", str(out), *extra]  # fmt: skip
    config = "configs/demo.yaml" if job == "bert" else "configs/pretrain_decoder_tiny.yaml"
    return [
        sys.executable,
        str(tree / "run_pretraining.py"),
        "--config",
        str(tree / config),
        "--output-dir",
        str(out),
        *extra,
    ]


def short_multilabel(path: Path) -> Path:
    """BBC headlines' first 8 words as JSON lines, labels [topic] (+ "number" with a digit)."""
    sys.path.insert(0, str(HERE))
    from packed_transformers.data.assets import write_news_jsonl

    write_news_jsonl(path.with_suffix(".full.jsonl"))
    lines = []
    for line in path.with_suffix(".full.jsonl").read_text().splitlines():
        example = json.loads(line)
        text = " ".join(example["text"].split()[:8])
        labels = [example["label"]] + (["number"] if any(c.isdigit() for c in text) else [])
        lines.append(json.dumps({"text": text, "label": labels}))
    path.write_text("\n".join(lines) + "\n")
    return path


def bbc_pairs(path: Path) -> Path:
    """BBC News pairs as `packed embedding-texts --kind pairs` writes them (this tree's command)."""
    subprocess.run([sys.executable, "-m", "packed_transformers.commands.packed", "embedding-texts", "--kind", "pairs",
                    "--output", str(path)], check=True, cwd=HERE, env=dict(os.environ, PYTHONPATH=str(HERE)))  # fmt: skip
    return path


def figures(job: str, out: Path, wall: float) -> dict:
    if job in FINETUNING:
        summary = json.loads((out / "summary.json").read_text())
        score = "validation_accuracy" if job == "finetune" else "validation_loss"
        return {"figure": summary["train_examples_per_second"], "check": summary[score],
                "steps": summary["train_steps"]}  # fmt: skip
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x.get("kind") == "train"]
    if job == "bert":
        end = next(x for x in lines if x.get("kind") == "end")
        return {"figure": end["train_seconds"], "check": train[-1]["loss"], "steps": end["step"]}
    return {"figure": wall, "check": train[-1]["loss"], "steps": train[-1]["step"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bert-steps", type=int, default=120)
    parser.add_argument("--decoder-steps", type=int, default=40)
    parser.add_argument("--jobs", nargs="+", default=["bert", "decoder", "finetune", "multilabel"])
    parser.add_argument("--scratch", type=Path, default=Path("bench_out/side_by_side_training"))
    args = parser.parse_args()
    trees = {"old": args.old.resolve(), "new": HERE}
    scratch = args.scratch.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    rows = decoder_rows(scratch / "rows") if "decoder" in args.jobs else None
    texts = short_multilabel(scratch / "short_multilabel.jsonl") if "multilabel" in args.jobs else None
    pairs = bbc_pairs(scratch / "pairs.jsonl") if "contrastive" in args.jobs else None
    results = {job: {name: [] for name in trees} for job in args.jobs}
    for round_ in range(args.rounds):
        order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
        for job in args.jobs:
            for name in order:
                out = scratch / f"{name}_{job}_{round_}"
                subprocess.run(["rm", "-rf", str(out)], check=True)
                started = time.perf_counter()
                data = {"multilabel": texts, "contrastive": pairs}.get(job, rows)
                done = subprocess.run(command(job, trees[name], out, args, data), cwd=trees[name], capture_output=True,
                                      text=True, env=dict(os.environ, PYTHONPATH=str(trees[name])))  # fmt: skip
                wall = time.perf_counter() - started
                if done.returncode:
                    print(f"{name} {job}: {done.stderr[-3000:]}", file=sys.stderr)
                    return 1
                results[job][name].append(figures(job, out, wall))
    report = {}
    for job, by_tree in results.items():
        report[job] = {
            "unit": "training examples/s" if job in FINETUNING else "seconds",
            **{
                f"{name}_median": statistics.median(r["figure"] for r in rounds)
                for name, rounds in by_tree.items()
            },
            **{f"{name}_rounds": [round(r["figure"], 2) for r in rounds] for name, rounds in by_tree.items()},
            "same_result": all(
                abs(a["check"] - b["check"]) <= 1e-4 * max(abs(a["check"]), 1e-12)
                and a["steps"] == b["steps"]
                for a, b in zip(by_tree["old"], by_tree["new"])
            ),
            "identical": all(
                a["check"] == b["check"] for a, b in zip(by_tree["old"], by_tree["new"])
            ),  # fmt: skip
            "checks": {name: rounds[0]["check"] for name, rounds in by_tree.items()},
        }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
