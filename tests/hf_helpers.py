"""A real transformers Trainer over packed data, and its accuracy metric, for the tests.

Shared by several test modules (no test module imports another)."""

from __future__ import annotations

from transformers import (
    Trainer,
    TrainingArguments,
)

from packed_transformers.hf_integration.trainer import (
    PackedDataCollator,
    packed_metrics,
)


def trainer_for(model, args_dir, train, evaluation=None, metrics=None, collator=None, **arguments):
    """A real Trainer over packs; arguments override TrainingArguments; metrics: a
    compute_metrics (default: single-label accuracy through packed_metrics); collator:
    default PackedDataCollator()."""
    options = dict(
        output_dir=str(args_dir),
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        learning_rate=1e-3,
        max_steps=30,
        logging_steps=5,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        data_seed=0,
    )
    options.update(arguments)
    return Trainer(
        model=model,
        args=TrainingArguments(**options),
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collator or PackedDataCollator(),
        compute_metrics=metrics or packed_metrics("single_label_classification", accuracy),
    )


def accuracy(rows):
    return {"accuracy": float((rows.predictions.argmax(-1) == rows.labels).mean())}
