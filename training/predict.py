"""Inference with any batching mode; predictions come back in input order.

    python -m training.predict --model runs/bbc_packed/model --input texts.jsonl \
        --output predictions.jsonl [--batching packed] [--batch-size 64]

--model is a folder written by `python -m training.finetune` (Hugging Face weights +
vocab.txt + finetune.json). --input is JSON lines with the text (and optional text pair)
fields the model was trained with; labels, when present, are scored. Each output line is
{"index": i, "label": name, "scores": [...]} (multi-label: "labels": [names]) for the i-th
input line, in input order whatever the batching (packs hold examples out of order; the
example indices put them back).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from data.classification_data import ExampleError, encode_labels, read_jsonl, tokenize
from data.create_pretraining_data import DataInputError, load_tokenizer
from model.classification import PackedBertForSequenceClassification, classification_metrics
from packing.errors import PackingInputError
from packing.io_utils import atomic_path, write_json_atomic
from packing.tokenized import unpack_outputs
from training.batching import MODES, Batcher, BatchingSpec, collate

FINETUNE_INFO = "finetune.json"  # labels, multi_label, max_sequence_length, fields: beside the weights


@torch.inference_mode()
def predict_logits(model, data, batcher: Batcher) -> tuple[np.ndarray, dict]:
    """Logits float32 [n, C] in input order, and timing/padding figures of the pass."""
    model.eval()
    device = next(model.parameters(), torch.empty(0)).device
    batches = batcher.epoch(0, shuffle=False)
    start = time.perf_counter()
    logits, index = [], []
    for table in batches:
        batch = to_device(collate(data, table, batcher.width(table), with_labels=False), device)
        logits.append(model(**batch)["logits"].float().cpu().numpy())  # .cpu() waits for the device
        index.append(table)
    seconds = time.perf_counter() - start
    # Dynamic widths differ per batch, but every mode's slots are [rows, K]: concatenate slots.
    in_order = unpack_outputs(np.concatenate(logits), np.concatenate(index), len(data))
    n = len(data)
    return in_order, {
        "examples": n,
        "seconds": seconds,
        "examples_per_second": n / seconds,
        "batches": len(batches),
        "padding_fraction": batcher.padding_fraction(batches),
    }


def to_device(batch: dict, device: torch.device) -> dict:
    return {name: value.to(device, non_blocking=True) for name, value in batch.items()}


def score(logits: np.ndarray, labels: np.ndarray, multi_label: bool) -> dict:
    """Loss, accuracy (multi-label: per label) and macro ROC-AUC of input-order logits [n, C]."""
    from sklearn.metrics import roc_auc_score

    logits_t = torch.from_numpy(logits)[:, None]
    labels_t = torch.from_numpy(labels)[:, None]
    present = torch.ones(logits_t.shape[:2], dtype=torch.bool)
    metrics = classification_metrics(logits_t, labels_t, present, multi_label)
    out = {
        "loss": float(metrics["loss_sum"] / metrics["count"]),
        "accuracy": float(metrics["correct"]) / float(metrics["correct_count"]),
    }
    if multi_label:
        truth, scores = labels.astype(np.int64), 1 / (1 + np.exp(-logits))
    else:
        truth = np.eye(logits.shape[1], dtype=np.int64)[labels]
        scores = torch.softmax(torch.from_numpy(logits), -1).numpy()
    # ROC-AUC needs both outcomes in a column; classes with one are left out and counted.
    usable = [c for c in range(truth.shape[1]) if 0 < truth[:, c].sum() < len(truth)]
    out["roc_auc"] = (
        float(roc_auc_score(truth[:, usable], scores[:, usable], average="macro")) if usable else None
    )
    out["roc_auc_classes"] = len(usable)
    return out


def write_predictions(path: Path, logits: np.ndarray, label_names: list[str], multi_label: bool) -> None:
    """JSON lines in input order, written to a temporary name and renamed."""
    if multi_label:
        scores = 1 / (1 + np.exp(-logits))
    else:
        scores = torch.softmax(torch.from_numpy(logits), -1).numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, tmp.open("w") as f:
        for i, row in enumerate(scores):
            record = {"index": i}
            if multi_label:
                record["labels"] = [label_names[c] for c in np.flatnonzero(row > 0.5)]
            else:
                record["label"] = label_names[int(row.argmax())]
            record["scores"] = [round(float(x), 6) for x in row]
            f.write(json.dumps(record) + "\n")


def load_finetuned(folder: Path):
    """(model, info, tokenizer, vocab) from a `training.finetune` output model folder."""
    info_path = folder / FINETUNE_INFO
    if not info_path.is_file():
        raise ExampleError(f"{folder}: no {FINETUNE_INFO}; expected a folder written by training.finetune")
    info = json.loads(info_path.read_text())
    tokenizer, vocab = load_tokenizer(folder / "vocab.txt")
    model = PackedBertForSequenceClassification.from_pretrained(folder)
    return model, info, tokenizer, vocab


def quiet_transformers() -> None:
    """transformers' load report and progress bars repeat what our log says in one line."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.predict", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="training.finetune output model folder")
    parser.add_argument("--input", required=True, type=Path, help="JSON lines to classify")
    parser.add_argument("--output", required=True, type=Path, help="predictions, JSON lines, input order")
    parser.add_argument("--batching", default="packed", choices=MODES)
    parser.add_argument("--batch-size", type=int, default=64, help="examples per batch")
    parser.add_argument("--max-sequences-per-pack", type=int, default=6)
    parser.add_argument("--algorithm", default="lpfhp", choices=("spfhp", "lpfhp", "nnlshp", "lp"))
    parser.add_argument(
        "--pack-length", type=int, default=None, help="tokens per pack (default: the model's)"
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    quiet_transformers()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: torch sees no GPU on this machine", file=sys.stderr)
        return 2
    try:
        model, info, tokenizer, vocab = load_finetuned(args.model)
        fields = info["fields"]
        examples = read_jsonl(args.input, fields["text"], fields["pair"], fields["label"], need_labels=False)
        has_labels = all(label is not None for label in examples.labels)
        labels = (
            encode_labels(examples, info["labels"], info["multi_label"])
            if has_labels
            else np.zeros(len(examples), dtype=np.int64)
        )
        data = tokenize(examples, tokenizer, vocab, labels, info["max_sequence_length"], info["too_long"])
        spec = BatchingSpec(
            args.batching,
            args.batch_size,
            info["max_sequence_length"],
            args.max_sequences_per_pack,
            args.algorithm,
            pack_length=args.pack_length or info.get("pack_length"),
        )
        logits, timing = predict_logits(model.to(args.device), data, Batcher(data.lengths, spec, seed=0))
    except (ExampleError, DataInputError, FileNotFoundError, PackingInputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    write_predictions(args.output, logits, info["labels"], info["multi_label"])
    report = {"batching": args.batching, **timing, "truncated": data.truncated}
    if has_labels:
        report.update(score(logits, labels, info["multi_label"]))
    write_json_atomic(args.output.with_suffix(".summary.json"), report)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
