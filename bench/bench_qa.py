"""Question answering at SQuAD's window lengths: the four batching modes and transformers'
own padded recipe, side by side in one process.

    python bench/bench_qa.py [--train-windows 256] [--infer-windows 512] [--rounds 2]

Windows are drawn from SQuAD v1.1's published length histogram at 384 tokens
(packing/histograms/squad_384.json): [CLS] question (8-20 tokens) [SEP] context [SEP],
random WordPiece ids, a random answer span of at most 30 tokens in the context. One
model (MiniLM-L6 with a QA head; the config's attention backend), one optimizer recipe
(fused AdamW, clipping at 1.0, finetune.train's step). Every round times each row once,
in a rotated order (machines here are noisy); the table gives the median:

  padded / dynamic / uniform / packed   our PackedBertForQuestionAnswering in each mode
  transformers padded                   BertForQuestionAnswering on windows padded to 384
                                        with an attention mask, the run_qa.py default
                                        (pad_to_max_length), the same AdamW step

Training counts windows/s over real optimizer steps (batch 32 windows; packed: ~32 /
packing factor packs); inference counts windows/s over the evaluation batches (64).
The packing factor printed is the plan's (lp, K=3).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from packed_transformers.components.batches import collate  # noqa: E402
from packed_transformers.components.step import set_learning_rate  # noqa: E402
from packed_transformers.data import assets  # noqa: E402
from packed_transformers.data.qa_windows import QaWindows  # noqa: E402
from packed_transformers.engines.torch_engine import StepSettings, TorchStep  # noqa: E402
from packed_transformers.finetune.config import load_finetune_config  # noqa: E402
from packed_transformers.finetune.qa_task import build_qa_model  # noqa: E402
from packed_transformers.finetune.train import batching_spec, build_adamw, finetune_step  # noqa: E402
from packed_transformers.inference.question_answering import predict_spans  # noqa: E402
from packed_transformers.model.hf_checkpoint import quiet_transformers  # noqa: E402
from packed_transformers.packs.batching import BATCHING_MODES, Batcher  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "finetune_qa_bbc.yaml"
HISTOGRAM = ROOT / "packed_transformers" / "packing" / "histograms" / "squad_384.json"
HF = "transformers padded"


def squad_windows(n: int, seed: int) -> QaWindows:
    """n synthetic windows with SQuAD-384's length distribution (see the module doc)."""
    rng = np.random.default_rng(seed)
    counts = np.asarray(json.loads(HISTOGRAM.read_text())["counts"], dtype=np.float64)
    lengths = rng.choice(np.arange(1, len(counts) + 1), size=n, p=counts / counts.sum())
    tokens, segments, labels = [], [], []
    for length in np.maximum(lengths, 32):
        question = int(rng.integers(8, 21))
        ids = rng.integers(1000, 30000, size=length).astype(np.int32)
        ids[0], ids[question + 1], ids[-1] = 101, 102, 102
        seg = np.zeros(length, dtype=np.int32)
        seg[question + 2 :] = 1
        start = int(rng.integers(question + 2, length - 1))
        end = min(length - 2, start + int(rng.integers(0, 30)))
        tokens.append(ids)
        segments.append(seg)
        labels.append((start, end))
    offsets = [np.full((len(t), 2), -1, dtype=np.int32) for t in tokens]
    return QaWindows(tokens, segments, offsets, np.array(labels, dtype=np.int64), np.arange(n))


def with_mode(config: dict, mode: str) -> dict:
    config = copy.deepcopy(config)
    config["batching"]["mode"] = mode
    return config


def time_ours(model, windows, config, mode, train_windows) -> tuple[float, float, float]:
    """(training windows/s, inference windows/s, training padding fraction)."""
    config = with_mode(config, mode)
    batcher = Batcher(
        windows.lengths[:train_windows], batching_spec(config, config["batching"]["batch_size"]), 0
    )
    batches = batcher.epoch(0)
    optimizer, schedule = build_adamw(model, config["optim"], 1000)
    engine = TorchStep(model, optimizer, model, StepSettings(torch.device("cpu"), max_grad_norm=1.0))
    finetune_step(engine, collate(windows, batches[0], batcher.width(batches[0])), schedule(0))
    start = time.perf_counter()  # after one warm-up step
    for step, table in enumerate(batches[1:], 1):
        finetune_step(engine, collate(windows, table, batcher.width(table)), schedule(step))
    train = sum(int((b >= 0).sum()) for b in batches[1:]) / (time.perf_counter() - start)
    eval_batcher = Batcher(windows.lengths, batching_spec(config, config["batching"]["eval_batch_size"]), 0)
    _, _, timing = predict_spans(model, windows, eval_batcher)
    return train, timing["examples_per_second"], batcher.padding_fraction(batches)


def hf_batches(windows, indices, batch_size, width):
    for first in range(0, len(indices), batch_size):
        chosen = indices[first : first + batch_size]
        ids = torch.zeros(len(chosen), width, dtype=torch.long)
        types, mask = torch.zeros_like(ids), torch.zeros_like(ids)
        for row, w in enumerate(chosen):
            n = len(windows.token_ids[w])
            ids[row, :n] = torch.from_numpy(windows.token_ids[w].astype(np.int64))
            types[row, :n] = torch.from_numpy(windows.segment_ids[w].astype(np.int64))
            mask[row, :n] = 1
        labels = torch.from_numpy(windows.labels[chosen])
        yield {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}, labels


def time_transformers(reference, windows, config, train_windows) -> tuple[float, float, float]:
    """run_qa.py's recipe: every window padded to 384, attention mask, HF's loss."""
    width = config["data"]["max_sequence_length"]
    optimizer, schedule = build_adamw(reference, config["optim"], 1000)
    steps = [0]
    order = np.random.default_rng(0).permutation(train_windows)
    batches = list(hf_batches(windows, order, config["batching"]["batch_size"], width))

    def step(inputs, labels):
        reference.train()
        out = reference(**inputs, start_positions=labels[:, 0], end_positions=labels[:, 1])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0, foreach=True)
        set_learning_rate(optimizer, schedule(steps[0]))  # the same schedule as ours, written as ours is
        optimizer.step()
        steps[0] += 1
        optimizer.zero_grad(set_to_none=True)

    step(*batches[0])
    start = time.perf_counter()
    for inputs, labels in batches[1:]:
        step(inputs, labels)
    train = (train_windows - len(batches[0][1])) / (time.perf_counter() - start)
    reference.eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for inputs, _ in hf_batches(
            windows, np.arange(len(windows)), config["batching"]["eval_batch_size"], width
        ):
            out = reference(**inputs)
            out.start_logits.numpy(), out.end_logits.numpy()
    infer = len(windows) / (time.perf_counter() - start)
    padding = 1 - windows.lengths[:train_windows].sum() / (train_windows * width)
    return train, infer, padding


def main() -> None:
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, description=__doc__.split("\n")[0]
    )
    parser.add_argument("--train-windows", type=int, default=256)
    parser.add_argument("--infer-windows", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", nargs="+", default=[*BATCHING_MODES, HF])
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args()
    quiet_transformers()
    config = load_finetune_config(CONFIG, args.set)
    windows = squad_windows(max(args.train_windows, args.infer_windows), seed=0)
    model = build_qa_model(config, str(assets.model_dir())).model
    from transformers import BertForQuestionAnswering

    reference = BertForQuestionAnswering.from_pretrained(assets.model_dir(), attn_implementation="sdpa")
    factor = Batcher(windows.lengths, batching_spec(with_mode(config, "packed"), 32), 0).packing_factor
    print(
        f"# {len(windows)} windows from SQuAD-384's histogram (mean {windows.lengths.mean():.0f} tokens), "
        f"{assets.model_label()} QA, backend {config['model']['attention_backend']}, packing factor {factor:.2f} "
        f"(lp, K={config['batching']['max_sequences_per_pack']}), torch threads {torch.get_num_threads()}"
    )
    results = {row: {"train": [], "infer": []} for row in args.rows}
    padding = {}
    for r in range(args.rounds):
        order = args.rows[r % len(args.rows) :] + args.rows[: r % len(args.rows)]
        for row in order:
            if row == HF:
                train, infer, pad = time_transformers(reference, windows, config, args.train_windows)
            else:
                train, infer, pad = time_ours(model, windows, config, row, args.train_windows)
            results[row]["train"].append(train)
            results[row]["infer"].append(infer)
            padding[row] = pad
            print(
                f"round {r + 1}: {row}: train {train:.1f}, inference {infer:.1f} windows/s", file=sys.stderr
            )
    median = {row: {k: statistics.median(v) for k, v in results[row].items()} for row in args.rows}
    base = median.get("padded")
    print()
    print("| rows | train windows/s | vs padded | inference windows/s | vs padded | training padding |")
    print("|---|---|---|---|---|---|")
    for row in args.rows:
        m = median[row]
        ratio = {k: f"{m[k] / base[k]:.2f}x" if base else "-" for k in ("train", "infer")}
        print(
            f"| {row} | {m['train']:.1f} | {ratio['train']} | {m['infer']:.1f} | {ratio['infer']} | {padding[row]:.1%} |"
        )
    if "packed" in median and "padded" in median:
        inference = median["packed"]["infer"] / median["padded"]["infer"]
        print(
            f"packed/padded inference {inference:.2f}x = {inference / factor:.2f} x the packing factor "
            f"(goal >= 0.9); packed/uniform training "
            f"{median['packed']['train'] / median.get('uniform', median['packed'])['train']:.2f}x (goal >= 1)"
        )
    if HF in median and "packed" in median:
        print(
            f"packed vs transformers padded: training {median['packed']['train'] / median[HF]['train']:.2f}x, "
            f"inference {median['packed']['infer'] / median[HF]['infer']:.2f}x"
        )


if __name__ == "__main__":
    main()
