"""Fine-tune a classifier with Hugging Face's Trainer on packed rows, then classify new text
through the saved folder: the README's Trainer recipe, whole and runnable offline.

    python examples/trainer/classify_with_trainer.py [--train 400] [--epochs 1] [--output work/trainer_model]

The data: BBC News headlines and first sentences from the installed corpus (5 classes). The
model: `packed assets model` (all-MiniLM-L6-v2's encoder) with a new classifier head.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from datasets import Dataset
from transformers import AutoTokenizer, Trainer, TrainingArguments

from packed_transformers.data.assets import corpus_glob, model_dir
from packed_transformers.data.classification_data import read_bbc_news
from packed_transformers.hf_integration.pipeline import packed_pipeline
from packed_transformers.hf_integration.trainer import PackedDataCollator, pack_dataset, packed_metrics
from packed_transformers.model.bert_heads import PackedBertForSequenceClassification as Packed


def compute_metrics(prediction):  # as Trainer users write it: one row per example
    logits, labels = prediction
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=400, help="training examples (another 20%% held out)")
    parser.add_argument("--epochs", type=float, default=1)
    parser.add_argument("--output", default="work/trainer_model")
    parser.add_argument(
        "--verbose", action="store_true", help="the libraries' load reports and progress bars too"
    )
    args = parser.parse_args()
    if not args.verbose:  # the libraries' load report and bars: only Trainer's own progress and results shown
        import datasets
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        datasets.disable_progress_bars()

    news = read_bbc_news(corpus_glob())  # examples: text (the headline), text pair, label name
    names = sorted(set(news.labels))
    order = np.random.default_rng(0).permutation(len(news.texts))[: args.train + args.train // 5]
    rows = {"text": [news.texts[i] for i in order], "label": [names.index(news.labels[i]) for i in order]}
    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    tokenized = Dataset.from_dict(rows).map(
        lambda batch: tokenizer(batch["text"], truncation=True, max_length=128), batched=True
    )
    train, held_out = tokenized.select(range(args.train)), tokenized.select(range(args.train, len(tokenized)))
    task = "single_label_classification"
    packed = pack_dataset(train, task, max_sequence_length=128, num_labels=len(names))
    packed_eval = pack_dataset(held_out, task, max_sequence_length=128, num_labels=len(names))

    model = Packed.from_pretrained(model_dir(), num_labels=len(names), new_head=True,
                                   id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)})  # fmt: skip
    training = TrainingArguments(output_dir=f"{args.output}-trainer", num_train_epochs=args.epochs,
                                 per_device_train_batch_size=8, learning_rate=1e-4, report_to="none",
                                 use_cpu=True, save_strategy="no", remove_unused_columns=False)  # fmt: skip
    trainer = Trainer(model, training, PackedDataCollator(), packed, packed_eval, processing_class=tokenizer,
                      compute_metrics=packed_metrics(task, compute_metrics))  # fmt: skip
    trainer.train()
    print(
        json.dumps(trainer.evaluate())
    )  # eval_accuracy over the held-out examples, eval_loss their exact mean
    trainer.save_model(args.output)  # the weights, config and (processing_class) the tokenizer
    classify = packed_pipeline("text-classification", model=args.output)
    print(
        json.dumps(
            classify(
                ["Shares rise as the bank reports record profits", "The striker scored twice in the final"]
            )
        )
    )


if __name__ == "__main__":
    main()
