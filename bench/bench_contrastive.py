"""Packed contrastive training against sentence-transformers' own trainer, as whole processes
(issue 97): the same model, pairs, batch, epochs, learning rate and seed.

    python bench/bench_contrastive.py [--pairs 1600] [--rounds 1] [--threads 2] [--batch 32]

Pairs: BBC News (title -> its first two paragraphs: `packed embedding-texts --kind pairs`),
a tenth held out. Each way runs in a fresh interpreter:

  sentence-transformers  SentenceTransformerTrainer(model=SentenceTransformer(MiniLM),
                         loss=MultipleNegativesRankingLoss, batch_sampler=NO_DUPLICATES,
                         per_device_train_batch_size=--batch, learning_rate 2e-5, warmup_ratio
                         0.1, 1 epoch, seed 42): its users' script, padded batches
  sentence-transformers  the same script with one line added after the model is loaded,
  + pack_sentence_       pack_sentence_transformer(model) (hf_integration/st_packing.py): its
  transformer            trainer, loss and sampler, each call's texts on packed rows
  packed                 packed train --config configs/finetune_embedding.yaml (the same
                         settings): each step's texts packed into rows

Both models are then embedded by sentence-transformers' encode and scored the same way on the
held-out pairs (each title against every held-out passage: nDCG@10, recall@1). Prints the
whole-process seconds, pairs/s, the padding each side computed on, and the scores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

ST_SCRIPT = """
import json, sys
import numpy as np
from datasets import Dataset
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.losses import MultipleNegativesRankingLoss
from sentence_transformers.sentence_transformer.training_args import BatchSamplers
model_dir, train_file, output, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rows = [json.loads(line) for line in open(train_file)]
model = SentenceTransformer(model_dir, device="cpu")
model.max_seq_length = 256
packing = None
if sys.argv[5] == "packed":
    from packed_transformers.hf_integration.st_packing import pack_sentence_transformer
    packing = pack_sentence_transformer(model)
data = Dataset.from_dict({"anchor": [r["anchor"] for r in rows], "positive": [r["positive"] for r in rows]})
tokenizer = model.tokenizer
real = padded = 0
for first in range(0, len(rows), batch):  # what its padded batches compute on (its sampler's order aside)
    for column in ("anchor", "positive"):
        lengths = [min(len(tokenizer(r[column])["input_ids"]), 256) for r in rows[first:first + batch]]
        real += sum(lengths); padded += max(lengths) * len(lengths)
args = SentenceTransformerTrainingArguments(output_dir=output + "/trainer", num_train_epochs=1,
    per_device_train_batch_size=batch, learning_rate=2e-5, warmup_ratio=0.1, seed=42,
    batch_sampler=BatchSamplers.NO_DUPLICATES, save_strategy="no", report_to="none", use_cpu=True,
    logging_steps=1000, dataloader_drop_last=False)
SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                           loss=MultipleNegativesRankingLoss(model)).train()
model.save(output + "/model")
print(json.dumps({"padding_fraction": packing.padding["packed"] if packing else 1 - real / padded}))
"""


def timed(argv: list[str], env: dict) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed: {done.stderr[-3000:]}")
    return time.perf_counter() - started, done.stdout


def scores(folder: Path, held_out: list[dict]) -> dict:
    from sentence_transformers import SentenceTransformer

    from packed_transformers.model.embedding import retrieval_scores

    model = SentenceTransformer(str(folder), device="cpu")
    anchors = model.encode([r["anchor"] for r in held_out], convert_to_numpy=True)
    positives = model.encode([r["positive"] for r in held_out], convert_to_numpy=True)
    return retrieval_scores(anchors, positives)


def main() -> int:
    from packed_transformers.data.assets import corpus_glob, model_dir
    from packed_transformers.data.embedding_texts import bbc_articles, pairs_of

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=1600)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    pairs = pairs_of(bbc_articles(corpus_glob()))
    order = np.random.default_rng(0).permutation(len(pairs))[: args.pairs]
    held = len(order) // 10
    held_out, train = [pairs[i] for i in order[:held]], [pairs[i] for i in order[held:]]
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(args.threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        ORT_DISABLE_TELEMETRY="1",
    )
    results: dict[str, list] = {
        "sentence-transformers": [],
        "sentence-transformers + packing": [],
        "packed": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        train_file = scratch / "train.jsonl"
        train_file.write_text("".join(json.dumps(r) + "\n" for r in train))
        held_file = scratch / "held.jsonl"
        held_file.write_text("".join(json.dumps(r) + "\n" for r in held_out))
        for round_ in range(args.rounds):
            for name in list(results)[round_ % 3 :] + list(results)[: round_ % 3]:
                out = scratch / f"{name}-{round_}"
                if name == "packed":
                    argv = [sys.executable, "-m", "packed_transformers.finetune.train", "--config",
                            str(REPO / "configs/finetune_embedding.yaml"), "--output-dir", str(out),
                            "--set", f"data.train_file={train_file}", "--set", f"data.validation_file={held_file}",
                            "--set", f"batching.batch_size={args.batch}", "--set", "training.progress=false",
                            "--set", f"execution.threads={args.threads}"]  # fmt: skip
                    seconds, stdout = timed(argv, env)
                    summary = json.loads((out / "summary.json").read_text())
                    padding = summary["train_padding_fraction"]
                else:
                    how = "packed" if name.endswith("packing") else "padded"
                    seconds, stdout = timed([sys.executable, "-c", ST_SCRIPT, str(model_dir()), str(train_file),
                                             str(out), str(args.batch), how], env)  # fmt: skip
                    padding = json.loads(stdout.strip().splitlines()[-1])["padding_fraction"]
                figures = {"seconds": seconds, "pairs_per_second": len(train) / seconds, "padding_fraction": padding,
                           **scores(out / "model", held_out)}  # fmt: skip
                results[name].append(figures)
                print(f"round {round_} {name}: {json.dumps({k: round(v, 4) for k, v in figures.items()})}",
                      file=sys.stderr, flush=True)  # fmt: skip
    print(
        f"# {len(train)} training pairs, {held} held out, batch {args.batch}, 1 epoch, {args.threads} threads"
    )
    print(
        "| trainer | whole process, s | pairs/s | padding computed on | nDCG@10 | recall@1 |\n|---|---|---|---|---|---|"
    )
    for name, runs in results.items():
        med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
        print(f"| {name} | {med['seconds']:.1f} | {med['pairs_per_second']:.2f} | {med['padding_fraction']:.1%} | "
              f"{med['ndcg@10']:.4f} | {med['recall@1']:.4f} |")  # fmt: skip
    for name in ("packed", "sentence-transformers + packing"):
        ratios = [
            s["seconds"] / p["seconds"] for s, p in zip(results["sentence-transformers"], results[name])
        ]
        print(f"{name} / sentence-transformers, whole process: {np.median(ratios):.2f}x (goal >= 1.5x)")
    if args.json:
        from bench.machine import description

        args.json.write_text(json.dumps({"command": "python bench/bench_contrastive.py " + " ".join(sys.argv[1:]),
                                         "machine": description(), "results": results}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
