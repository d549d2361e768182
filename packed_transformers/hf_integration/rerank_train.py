"""`packed train` with data.task rerank: a cross-encoder (reranker) trained by sentence-transformers'
own `CrossEncoderTrainer`, its encoder run on packed rows (`pack_cross_encoder`, one line: the loss
and every gradient equal the padded computation, tests/hf_integration/test_ce_packing.py).

What: a reranker from any encoder folder (a new one-logit head, seeded by training.seed) or from a
folder that already is one, on JSON lines in sentence-transformers' column names:
    pointwise  {"query", "passage", "label"}             label 0/1 or a graded score
    grouped    {"query", "positive", "negative": [...]}  one positive, its negatives (a string or a
                                                          list; `packed mine-negatives` writes them)
rerank.loss: bce (BinaryCrossEntropyLoss, rerank.pos_weight; grouped lines become labelled pairs),
grouped (MultipleNegativesRankingLoss: the positive against its own negatives and the batch's, in one
softmax; grouped lines, each with rerank.negatives of them), listwise (LambdaLoss over each query's
candidates with their labels; pointwise lines are grouped by query). Validation: each held-out query's
candidates reranked by CrossEncoderRerankingEvaluator (nDCG@10, MRR@10), before training (the
untrained head) and after. The saved folder (`model/`) loads in sentence-transformers' CrossEncoder
and transformers' AutoModelForSequenceClassification.

How: the config's keys map onto CrossEncoderTrainingArguments (batching.batch_size pairs, groups or
lists a step; optim.*; training.epochs, seed, max_seconds); batching.mode padded runs the trainer
unpacked (the peer, for comparisons). Ctrl-C or SIGTERM ends after the step, saves the model so far
and says so.

Never: resumes (--resume is refused: the trainer's own checkpoints are not this project's; a run
starts again), shards (one process), or runs outside the CPU / one CUDA device.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from packed_transformers.common.config_schema import ConfigError, Key
from packed_transformers.data.classification_data import (
    ExampleError,
    bounded_lines,
    check_text,
    record_of_line,
    required_text,
)

log = logging.getLogger(__name__)

LOSSES = ("bce", "grouped", "listwise")

# finetune/config.py's "rerank" section
RERANK_KEYS: dict[str, Key] = {
    "loss": Key(
        str,
        "bce",
        "rerank: bce (pairs), grouped (a positive against its negatives) or listwise (LambdaLoss)",
        LOSSES,
    ),  # fmt: skip
    "pos_weight": Key(
        float, None, "rerank bce: weight of the positive pairs' loss; null = 1", optional=True, minimum=0
    ),  # fmt: skip
    "negatives": Key(
        int,
        None,
        "rerank grouped: negatives per line used; null = the fewest a line has",
        optional=True,
        minimum=1,
    ),  # fmt: skip
    "query_field": Key(str, "query", "rerank: jsonl field of the query"),
    "passage_field": Key(
        str, "passage", "rerank pointwise lines: jsonl field of the passage (with data.label_field)"
    ),
}


@dataclass
class Group:
    """One query's candidates: texts with their labels (1 relevant, 0 not, or a graded score)."""

    query: str
    texts: list[str] = field(default_factory=list)
    labels: list[float] = field(default_factory=list)
    where: str = ""

    @property
    def positives(self) -> list[str]:
        return [t for t, label in zip(self.texts, self.labels) if label > 0]

    @property
    def negatives(self) -> list[str]:
        return [t for t, label in zip(self.texts, self.labels) if label <= 0]


@dataclass(frozen=True)
class RerankData:
    """A file's groups, and whether its lines were grouped (one positive and negatives) or pointwise."""

    groups: list[Group]
    grouped: bool


def read_rerank_lines(path, config: dict) -> RerankData:
    """Pointwise or grouped JSON lines (module docstring) -> one Group per query (pointwise lines of a
    query gathered in file order; grouped lines kept one group each). The first line decides the
    form; a line of the other form, a missing field or a label that is not a number is one line
    naming file:line."""
    data, rerank = config["data"], config["rerank"]
    query_field, passage_field, label_field = (
        rerank["query_field"],
        rerank["passage_field"],
        data["label_field"],
    )
    positive_field, negative_field = data["positive_field"], data["negative_field"]
    groups: dict[str, Group] = {}
    ordered: list[Group] = []
    grouped = None
    with open(path, "rb") as f:
        for number, raw in bounded_lines(f, str(path)):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            record = record_of_line(raw, where)
            this_grouped = positive_field in record
            if grouped is None:
                grouped = this_grouped
            if this_grouped != grouped:
                form = (
                    f"grouped ('{positive_field}')"
                    if grouped
                    else f"pointwise ('{passage_field}', '{label_field}')"
                )
                raise ExampleError(f"{where}: a line of the other form; this file's first line is {form}")
            query = required_text(record, query_field, where, empty_ok=False)
            if grouped:
                negatives = record.get(negative_field, [])
                negatives = [negatives] if isinstance(negatives, str) else negatives
                if not isinstance(negatives, list) or not negatives:
                    raise ExampleError(
                        f"{where}: field '{negative_field}' must be a text or a non-empty list of texts"
                    )
                texts = [required_text(record, positive_field, where, empty_ok=False)]
                texts += [
                    check_text(n, f"{where}: field '{negative_field}'", empty_ok=False) for n in negatives
                ]
                ordered.append(Group(query, texts, [1.0] + [0.0] * len(negatives), where))
                continue
            label = record.get(label_field)
            if isinstance(label, bool) or not isinstance(label, int | float) or label != label:
                raise ExampleError(f"{where}: field '{label_field}' must be a number (0/1 or a graded score), "
                                   f"got {label!r}")  # fmt: skip
            if query not in groups:
                groups[query] = Group(query, where=where)
                ordered.append(groups[query])
            groups[query].texts.append(required_text(record, passage_field, where, empty_ok=False))
            groups[query].labels.append(float(label))
    if not ordered:
        raise ExampleError(f"{path}: no lines (empty file)")
    return RerankData(ordered, bool(grouped))


def split_groups(data: RerankData, config: dict) -> tuple[RerankData, list[Group]]:
    """(training groups, validation groups): data.validation_file's, or a data.validation_fraction
    share of the queries drawn with data.split_seed (a query's candidates never on both sides)."""
    settings = config["data"]
    if settings["validation_file"]:
        return data, read_rerank_lines(settings["validation_file"], config).groups
    order = list(range(len(data.groups)))
    random.Random(settings["split_seed"]).shuffle(order)
    held = max(1, round(len(order) * settings["validation_fraction"]))
    if held >= len(order):
        raise ExampleError(f"{settings['train_file']}: {len(order)} queries leave none to train on after holding "
                           f"out {held} for validation; give data.validation_file or more queries")  # fmt: skip
    held_out = set(order[:held])
    train = [g for i, g in enumerate(data.groups) if i not in held_out]
    return RerankData(train, data.grouped), [data.groups[i] for i in sorted(held_out)]


def training_rows(data: RerankData, loss: str, negatives: int | None) -> tuple[dict, str | None]:
    """The loss's dataset columns ({name: values}) and the mistake that makes the data unusable, or None."""
    if loss == "bce":
        pairs = [(g.query, t, label) for g in data.groups for t, label in zip(g.texts, g.labels)]
        return {
            "query": [p[0] for p in pairs],
            "passage": [p[1] for p in pairs],
            "label": [p[2] for p in pairs],
        }, None
    if loss == "listwise":
        return {"query": [g.query for g in data.groups], "docs": [g.texts for g in data.groups],
                "labels": [g.labels for g in data.groups]}, None  # fmt: skip
    if not data.grouped:
        return (
            {},
            "rerank.loss grouped reads grouped lines ({query, positive, negative}); these are pointwise",
        )
    fewest = min(len(g.negatives) for g in data.groups)
    wanted = negatives or fewest
    if wanted > fewest:
        short = next(g for g in data.groups if len(g.negatives) < wanted)
        return {}, f"{short.where}: {len(short.negatives)} negatives; rerank.negatives is {wanted}"
    columns = {"query": [g.query for g in data.groups], "positive": [g.positives[0] for g in data.groups]}
    for i in range(wanted):
        columns[f"negative_{i + 1}"] = [g.negatives[i] for g in data.groups]
    return columns, None


def evaluator_of(groups: list[Group], batch_size: int):
    """sentence-transformers' reranking evaluator over the held-out queries (nDCG@10, MRR@10)."""
    from sentence_transformers.cross_encoder.evaluation import CrossEncoderRerankingEvaluator

    samples = [
        {"query": g.query, "positive": g.positives, "negative": g.negatives} for g in groups if g.positives
    ]
    return CrossEncoderRerankingEvaluator(
        samples, at_k=10, batch_size=batch_size, write_csv=False, name="validation"
    )


def scores_of(metrics: dict) -> dict:
    """The evaluator's metrics -> {"ndcg@10", "mrr@10", "map"} (its keys carry its name)."""
    return {key.split("_", 1)[1]: round(float(value), 4) for key, value in metrics.items()
            if key.split("_", 1)[-1] in ("ndcg@10", "mrr@10", "map")}  # fmt: skip


def run_rerank(config: dict, output: Path, resume: bool = False, stop=None, overwrite: bool = False) -> dict:
    """The whole run (module docstring), its output folder locked as every run's for its length
    (a second run, or an --overwrite, refused beside it in one line) -> its summary (also written
    to output/summary.json)."""
    from packed_transformers.common.files import release_folder
    from packed_transformers.components.run_folder import lock_run_folder

    lock_run_folder(output, 0)  # one process: CrossEncoderTrainer's
    try:
        return _trained(config, output, resume, stop, overwrite)
    finally:
        release_folder(output)


def _trained(config: dict, output: Path, resume: bool, stop, overwrite: bool) -> dict:
    import torch
    from datasets import Dataset
    from sentence_transformers.cross_encoder import (
        CrossEncoder,
        CrossEncoderTrainer,
        CrossEncoderTrainingArguments,
        losses,
    )
    from transformers import TrainerCallback

    from packed_transformers.common.files import atomic_folder, write_json_atomic
    from packed_transformers.data.assets import resolve_asset
    from packed_transformers.hf_integration.st_packing import pack_cross_encoder

    if resume:
        raise ConfigError("--resume: a rerank run is sentence-transformers' CrossEncoderTrainer's and starts again "
                          "from its first step (run without --resume, with --overwrite)")  # fmt: skip
    data_settings, batching, optim, training = (
        config["data"],
        config["batching"],
        config["optim"],
        config["training"],
    )
    rerank = config["rerank"]
    clear_or_refuse(output, overwrite, remove=False)
    train_data, validation = split_groups(
        read_rerank_lines(resolve_asset(data_settings["train_file"]), config), config
    )
    columns, mistake = training_rows(train_data, rerank["loss"], rerank["negatives"])
    if mistake:
        raise ConfigError(mistake)
    clear_or_refuse(output, overwrite)  # the old run goes once this one's input is read and checked
    start = resolve_asset(config["model"]["init_checkpoint"])
    device = config["execution"]["device"]
    if config["execution"]["threads"]:
        torch.set_num_threads(config["execution"]["threads"])
    torch.manual_seed(training["seed"])  # a new head's initial weights
    model = CrossEncoder(start, num_labels=1, max_length=data_settings["max_sequence_length"], device=device)
    packing = pack_cross_encoder(model) if batching["mode"] == "packed" else None
    evaluator = evaluator_of(validation, batching["eval_batch_size"])
    untrained = scores_of(evaluator(model))
    loss = {
        "bce": lambda: losses.BinaryCrossEntropyLoss(
            model, pos_weight=None if rerank["pos_weight"] is None else torch.tensor(rerank["pos_weight"])
        ),
        "grouped": lambda: losses.MultipleNegativesRankingLoss(model, num_negatives=None),
        "listwise": lambda: losses.LambdaLoss(model),
    }[rerank["loss"]]()
    output.mkdir(parents=True, exist_ok=True)
    scratch = output / ".trainer"
    args = CrossEncoderTrainingArguments(
        output_dir=str(scratch), per_device_train_batch_size=batching["batch_size"],
        num_train_epochs=training["epochs"], learning_rate=optim["lr"], weight_decay=optim["weight_decay"],
        adam_beta1=optim["betas"][0], adam_beta2=optim["betas"][1], adam_epsilon=optim["eps"],
        warmup_ratio=optim["warmup_fraction"], max_grad_norm=optim["max_grad_norm"] or 1e9, seed=training["seed"],
        lr_scheduler_type="linear", save_strategy="no", report_to="none", disable_tqdm=not training["progress"],
        use_cpu=device == "cpu", logging_strategy="no", dataloader_drop_last=False,
    )  # fmt: skip
    ended = EndedBy(training["max_seconds"], stop)
    trainer = CrossEncoderTrainer(model=model, args=args, train_dataset=Dataset.from_dict(columns), loss=loss,
                                  callbacks=[ended.callback(TrainerCallback)])  # fmt: skip
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    planned = trainer.state.max_steps
    if packing is not None:
        packing.remove()  # the folder saved is the plain CrossEncoder's
    with atomic_folder(output / "model") as folder:
        model.save_pretrained(str(folder))
    import shutil

    shutil.rmtree(scratch, ignore_errors=True)
    summary = {
        "task": "rerank", "loss": rerank["loss"], "batching": batching["mode"], "start": start,
        "train_queries": len(train_data.groups), "validation_queries": len(validation),
        "steps": trainer.state.global_step, "train_seconds": round(seconds, 2),
        "validation_untrained": untrained, "validation": scores_of(evaluator(model)),
        **({"padded_cells_saved": round(1 - packing.count.packed_cells / max(packing.count.padded_cells, 1), 4)}
           if packing is not None else {}),
    }  # fmt: skip
    why = ended.why(trainer.state.global_step, planned)
    if why:
        summary["undertrained"] = why
    write_json_atomic(output / "summary.json", summary)
    if ended.signum is not None:
        raise RerankStopped(f"{why}; the model so far is saved in {output / 'model'}", ended.signum)
    return summary


class RerankStopped(RuntimeError):
    """Ctrl-C or SIGTERM ended the run after a step; the message says what was saved."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


RUN_FILES = ("model", "summary.json", ".trainer")  # what a rerank run writes in its folder


def clear_or_refuse(output: Path, overwrite: bool, remove: bool = True) -> None:
    """--overwrite removes a previous run's files (RUN_FILES only; `remove` False: only the
    refusal, asked before the input is read); without it a finished run is refused."""
    import shutil

    for name in RUN_FILES:
        path = output / name
        if not (path.exists() or path.is_symlink()):
            continue
        if not overwrite and name != ".trainer":
            raise ConfigError(f"--output-dir {output}: holds a finished run; choose another folder, or --overwrite "
                              "to replace it")  # fmt: skip
        if not remove:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


class EndedBy:
    """training.max_seconds and Ctrl-C / SIGTERM (finetune's StopSignal) as the trainer's callback:
    the step in progress ends, then training; `why` says which stopped it early."""

    def __init__(self, max_seconds: float | None, stop):
        self.max_seconds, self.stop = max_seconds, stop
        self.started = time.perf_counter()
        self.by: str | None = None
        self.signum: int | None = None

    def callback(self, base):
        ended = self

        class Ending(base):
            def on_step_end(self, args, state, control, **kwargs):
                if ended.stop is not None and ended.stop.is_set():
                    ended.by, ended.signum = "a signal", ended.stop.signum
                elif (
                    ended.max_seconds is not None and time.perf_counter() - ended.started > ended.max_seconds
                ):
                    ended.by = f"training.max_seconds={ended.max_seconds:g}"
                control.should_training_stop = control.should_training_stop or ended.by is not None
                return control

        return Ending()

    def why(self, steps: int, planned: int) -> str | None:
        if self.by is None or steps >= planned:
            return None
        return (f"stopped by {self.by} after {steps:,} of {planned:,} steps: the model is undertrained "
                "(give more seconds, or fewer examples)")  # fmt: skip
