"""`commands.predict` against a length-sorted transformers loop, each a whole process (imports,
loading, tokenizing, the forward, writing), on the same texts, the same threads, fp32.

    python bench/bench_predict_process.py [--model FOLDER --input TEXTS.jsonl] [--rounds 3] [--threads 2] [--bf16]

FOLDER: a transformers sequence-classification folder (save_pretrained). The peer is what a
transformers user writes without packing: AutoTokenizer, sort the texts by length, batches of
64 padded to their longest, AutoModelForSequenceClassification (SDPA), softmax, back to input
order, JSON lines out (`--peer` runs it: this file is its own script). Rounds alternate the
order of the two; the wall time of each process is measured from outside; the median and the
paired ratios are reported, and the two outputs' scores compared (max absolute difference).
--bf16 adds `commands.predict --dtype bfloat16` to the rounds: bf16 against fp32 as whole
processes (on a CPU without bf16 the command refuses in one line, and that line is reported).
--runtimes adds `--dtype int8` (torch's fbgemm kernels), `--runtime openvino` and `--runtime
openvino --dtype int8` (calibrated on the input's texts): each against the fp32 command as
whole processes, with its label agreement and largest score difference to fp32. Their graph
cache is a fresh folder: round 0 converts (and quantizes), later rounds read it back.
Inputs whose lines carry "label" (a held-out set of a trained folder) also get each way's
accuracy; lines with "text_pair" are fed as pairs to both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def sorted_loop(model_folder: str, input_path: str, output_path: str, batch_size: int = 64) -> None:
    """The peer, run in its own process: a length-sorted, padded transformers loop."""
    import numpy as np
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    records = [json.loads(line) for line in open(input_path, encoding="utf-8") if line.strip()]
    texts = [r["text"] for r in records]
    pairs = [r["text_pair"] for r in records] if records and "text_pair" in records[0] else None
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_folder, attn_implementation="sdpa"
    ).eval()
    encoded = tokenizer(texts, pairs, truncation=True)["input_ids"]
    order = np.argsort([len(ids) for ids in encoded], kind="stable")
    scores = [None] * len(texts)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            members = order[start : start + batch_size]
            batch = tokenizer.pad({"input_ids": [encoded[i] for i in members]}, return_tensors="pt")
            probabilities = torch.softmax(model(**batch).logits, -1).numpy()
            for i, row in zip(members, probabilities):
                scores[i] = row
    labels = [model.config.id2label[i] for i in range(model.config.num_labels)]
    with open(output_path, "w", encoding="utf-8") as out:
        for i, row in enumerate(scores):
            out.write(json.dumps({"index": i, "scores": dict(zip(labels, map(float, row)))}) + "\n")


def default_inputs(scratch: Path, texts: int) -> tuple[str, Path]:
    """Without --model / --input: the shipped MiniLM-L6 encoder saved as a transformers
    5-label sequence-classification folder (its head random: speed and equality need no
    training), and the first `texts` mixed BBC texts (data.embedding_texts)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from packed_transformers.data.assets import corpus_glob, model_dir
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of

    folder = scratch / "minilm_cls"
    AutoModelForSequenceClassification.from_pretrained(model_dir(), num_labels=5).save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_dir()).save_pretrained(folder)
    path = scratch / "texts.jsonl"
    chosen = texts_of(bbc_articles(corpus_glob()), "mixed")[:texts]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in chosen), encoding="utf-8")
    return str(folder), path


def bbc_heldout(scratch: Path) -> Path:
    """The validation split of configs/finetune_bbc.yaml (its validation_fraction and
    split_seed, the examples a folder trained by it never saw) as predict's labelled JSON
    lines: title as text, first sentence as text_pair, the class as label."""
    from packed_transformers.common.config_schema import read_yaml
    from packed_transformers.data.assets import corpus_glob
    from packed_transformers.data.classification_data import read_bbc_news, split_by_seed

    data = read_yaml(REPO / "configs/finetune_bbc.yaml")["data"]
    examples = read_bbc_news(corpus_glob())
    _, held_out = split_by_seed(len(examples.texts), data["validation_fraction"], data["split_seed"])
    path = scratch / "bbc_heldout.jsonl"
    lines = [
        {"text": examples.texts[i], "text_pair": examples.pairs[i], "label": examples.labels[i]}
        for i in held_out
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def timed(command: list[str], threads: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="default: MiniLM-L6 as a classification folder (default_inputs)")
    parser.add_argument("--input", type=Path, help="default: 2,000 mixed BBC texts")
    parser.add_argument(
        "--bbc-heldout",
        action="store_true",
        help="input: configs/finetune_bbc.yaml's validation split, labelled (for a folder it trained)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--texts", type=int, default=2000, help="without --input: this many mixed BBC texts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer", nargs=2, metavar=("INPUT", "OUTPUT"), help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, help="also write the JSON here")
    parser.add_argument("--bf16", action="store_true", help="also commands.predict --dtype bfloat16")
    parser.add_argument("--runtimes", action="store_true", help="also int8, OpenVINO fp32 and OpenVINO int8")
    args = parser.parse_args()
    if args.peer:
        import torch

        torch.set_num_threads(args.threads)
        sorted_loop(args.model, *args.peer)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        if args.bbc_heldout:
            args.input = bbc_heldout(Path(scratch))
        if args.model is None or args.input is None:
            model, texts_path = default_inputs(Path(scratch), args.texts)
            args.model, args.input = args.model or model, args.input or texts_path
        texts = sum(1 for line in args.input.open() if line.strip())
        ours_out, peer_out = Path(scratch) / "ours.jsonl", Path(scratch) / "peer.jsonl"
        commands = {
            "packed_transformers.finetune.predict": [sys.executable, "-m", "packed_transformers.finetune.predict", "--model", args.model, "--input",
                                 str(args.input), "--output", str(ours_out), "--overwrite"],
            "sorted transformers loop": [sys.executable, __file__, "--model", args.model, "--input", str(args.input),
                                         "--threads", str(args.threads), "--peer", str(args.input), str(peer_out)],
        }  # fmt: skip
        bf16_out, bf16_refusal = Path(scratch) / "bf16.jsonl", None
        if args.bf16:
            bf16 = commands["packed_transformers.finetune.predict"][:-3] + [
                "--output",
                str(bf16_out),
                "--overwrite",
                "--dtype",
                "bfloat16",
            ]
            probe = subprocess.run(bf16, cwd=REPO, capture_output=True, text=True)
            if probe.returncode == 0:
                commands["finetune.predict bf16"] = bf16
            else:
                bf16_refusal = (
                    probe.stderr.strip().splitlines()[-1]
                    if probe.stderr.strip()
                    else f"exit {probe.returncode}"
                )
        variants = {}  # name -> (its output, what it adds to the fp32 command)
        if args.runtimes:
            variants = {
                "predict int8": ("int8.jsonl", ["--dtype", "int8"]),
                "predict openvino": ("openvino.jsonl", ["--runtime", "openvino"]),
                "predict openvino int8": (
                    "openvino_int8.jsonl",
                    ["--runtime", "openvino", "--dtype", "int8"],
                ),
            }
            os.environ["PACKED_TRANSFORMERS_CACHE"] = str(Path(scratch) / "graph-cache")
            for name, (out, extra) in variants.items():
                commands[name] = commands["packed_transformers.finetune.predict"][:-3] + [
                    "--output", str(Path(scratch) / out), "--overwrite", *extra]  # fmt: skip
        seconds = {name: [] for name in commands}
        for round_number in range(args.rounds):
            names = list(commands)
            names = names[round_number % len(names) :] + names[: round_number % len(names)]
            for name in names:
                seconds[name].append(timed(commands[name], args.threads))
        ours = [json.loads(line)["scores"] for line in ours_out.read_text().splitlines()]
        peer = [json.loads(line)["scores"] for line in peer_out.read_text().splitlines()]
        low = (
            [json.loads(line)["scores"] for line in bf16_out.read_text().splitlines()]
            if bf16_out.exists()
            else []
        )
        fp32_labels = [json.loads(line)["label"] for line in ours_out.read_text().splitlines()]
        gold = [json.loads(line).get("label") for line in args.input.read_text().splitlines() if line.strip()]
        scored = all(g is not None for g in gold)
        accuracy = {"predict": sum(a == g for a, g in zip(fp32_labels, gold)) / len(gold)} if scored else {}
        against_fp32 = {}
        for name, (out, _) in variants.items():
            records = [json.loads(line) for line in (Path(scratch) / out).read_text().splitlines()]
            fp32, mine = seconds["packed_transformers.finetune.predict"], seconds[name]
            against_fp32[name] = {
                "speedup_paired": [round(a / b, 3) for a, b in zip(fp32, mine)],
                "speedup_median": round(statistics.median(a / b for a, b in zip(fp32, mine)), 3),
                "label_agreement": sum(r["label"] == f for r, f in zip(records, fp32_labels)) / len(records),
                "max_score_difference": max(abs(r["scores"][k] - o[k]) for r, o in zip(records, ours) for k in o),
                "labels_changed": sum(r["label"] != f for r, f in zip(records, fp32_labels)),
            }  # fmt: skip
            if scored:
                accuracy[name] = sum(r["label"] == g for r, g in zip(records, gold)) / len(gold)
    difference = max(abs(a[k] - b[k]) for a, b in zip(ours, peer) for k in a)
    ratios = [
        p / o
        for o, p in zip(seconds["packed_transformers.finetune.predict"], seconds["sorted transformers loop"])
    ]
    from bench.machine import description

    result = {
        "command": f"python bench/bench_predict_process.py {' '.join(sys.argv[1:])}",
        "machine": description(),
        "date": time.strftime("%Y-%m-%d"),
        "texts": texts,
        "threads": args.threads,
        "seconds": {name: [round(s, 2) for s in values] for name, values in seconds.items()},
        "median_seconds": {name: round(statistics.median(values), 2) for name, values in seconds.items()},
        "speedup_paired": [round(r, 3) for r in ratios],
        "speedup_median": round(statistics.median(ratios), 3),
        "max_score_difference": difference,
    }
    if against_fp32:
        result["against_fp32"] = against_fp32
    if accuracy:
        result["accuracy"] = accuracy
    if args.bf16 and bf16_refusal:
        result["bf16"] = f"not measured: {bf16_refusal}"
    elif args.bf16:
        fp32, bf16_seconds = seconds["packed_transformers.finetune.predict"], seconds["finetune.predict bf16"]
        result["bf16_over_fp32_paired"] = [round(a / b, 3) for a, b in zip(fp32, bf16_seconds)]
        result["bf16_over_fp32_median"] = round(
            statistics.median(a / b for a, b in zip(fp32, bf16_seconds)), 3
        )
        result["bf16_max_score_difference"] = max(abs(a[k] - b[k]) for a, b in zip(ours, low) for k in a)
    print(json.dumps(result, indent=1))
    if args.output:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
