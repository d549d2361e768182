"""Fine-tune a BERT checkpoint for text classification or extractive question answering
with packed (or padded) batches.

    python -m finetune.train --config configs/finetune_bbc.yaml --output-dir runs/bbc \
        [--set batching.mode=dynamic ...]

Data flow (classification): examples (jsonl or BBC News) -> labels checked -> WordPiece
ids -> train / validation split -> batch tables (finetune.batching: padded | dynamic |
uniform | packed) -> collate -> PackedBertForSequenceClassification -> per-example loss
-> AdamW step. Question answering (data.task: question_answering, finetune.qa_task):
SQuAD questions -> overlapping context windows with span labels -> the same batch tables
and step -> PackedBertForQuestionAnswering. After every epoch the validation set goes
through inference in the same batching mode, timed; the last pass's predictions are
written (classification in input order; QA as SQuAD's {question id: answer} file).

OUTPUT/
  model/                      Hugging Face folder (+ vocab.txt, finetune.json) for predict
  metrics.jsonl               one line per epoch: train loss/accuracy, validation metrics
  validation_predictions.jsonl   classification; QA: validation_predictions.json
  summary.json                mode, examples/s (training, inference), padding fractions, accuracy
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # path mistakes answered before torch is imported (common/preflight.py)
    from common.preflight import exit_on_path_mistakes

    exit_on_path_mistakes({"--config": "file"})

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from common.cli import command_parser, first_line
from common.config_schema import ConfigError
from common.files import describe_os_error, write_json_atomic
from data.classification_data import (
    ExampleError,
    Examples,
    TokenizedExamples,
    encode_labels,
    label_names_of,
    read_bbc_news,
    read_jsonl,
    split_by_seed,
    tokenize,
    tokenize_by_template,
)
from data.tokenizer import DataInputError, load_tokenizer
from finetune.batching import Batcher, BatchingSpec, collate
from finetune.config import load_finetune_config
from finetune.folder import check_config_values, save_finetuned
from finetune.inference import predict_logits, score, to_device, write_predictions
from model.families import UnsupportedFamily
from model.hf_checkpoint import quiet_transformers
from model.opening import ModelOptions, open_model, qa_fine_tuning_refusal
from optim import weight_decay_groups
from packing.errors import PackingInputError

log = logging.getLogger("finetune")


class FinetuneError(ValueError):
    """A run that cannot start (vocabulary mismatch, existing output); CLI exit code 2."""


@dataclass
class Task:
    """Everything the loop needs about the data, tokenized, in input order."""

    train: TokenizedExamples
    validation: TokenizedExamples
    label_names: list[str]
    vocab_file: Path | None  # None: the checkpoint's own tokenizer (tokenizer.json)


def resolve_asset(value: str | None) -> str | None:
    """'asset:model' / 'asset:corpus' -> the installed demo asset's path; anything else as is."""
    if value is None or not value.startswith("asset:"):
        return value
    from data import assets

    paths = {"asset:model": assets.model_dir, "asset:corpus": assets.corpus_glob}
    if value not in paths:
        raise ConfigError(f"{value!r}: unknown asset; expected one of {', '.join(paths)}")
    return str(paths[value]())


# ----- data ------------------------------------------------------------------------------
def check_vocabulary(checkpoint: Path, vocab_file: Path) -> None:
    """The tokenizer must produce the ids the checkpoint's embeddings were trained on."""
    tokens = vocab_file.read_text(encoding="utf-8").splitlines()
    own = checkpoint / "vocab.txt"
    if own.is_file() and own.resolve() != vocab_file.resolve():
        theirs = own.read_text(encoding="utf-8").splitlines()
        if theirs != tokens:
            row = next(
                (i for i, (a, b) in enumerate(zip(tokens, theirs)) if a != b), min(len(tokens), len(theirs))
            )
            raise FinetuneError(
                f"data.vocab_file {vocab_file} differs from the checkpoint's {own} at line {row + 1} "
                f"({len(tokens)} vs {len(theirs)} tokens): the checkpoint's embeddings expect its own "
                f"vocabulary; leave data.vocab_file null to use it"
            )
    model_vocab = json.loads((checkpoint / "config.json").read_text()).get("vocab_size")
    if model_vocab is not None and len(tokens) > model_vocab:
        raise FinetuneError(
            f"data.vocab_file {vocab_file} has {len(tokens)} tokens but the checkpoint {checkpoint} "
            f"embeds vocab_size={model_vocab}: token ids would fall outside its embedding table"
        )


def input_digest(config: dict) -> dict:
    """sha256 of the training and validation files (each file of a glob), so that --resume
    refuses data changed at the same path. -> {"train_file": hex, "validation_file": hex}."""
    import glob as globbing

    from common.files import sha256_file

    digests = {}
    for key in ("train_file", "validation_file"):
        spec = resolve_asset(config["data"].get(key))
        if spec is None:
            continue
        files = sorted(globbing.glob(spec)) if globbing.has_magic(spec) else [spec]
        digest = hashlib.sha256()
        for path in files:
            if os.path.isfile(path):
                digest.update(f"{path}\0{sha256_file(path)}\n".encode())
        digests[key] = digest.hexdigest()
    return digests


def read_examples(data: dict, path: str) -> Examples:
    if data["source"] == "bbc_news":
        return read_bbc_news(path)
    return read_jsonl(path, data["text_field"], data["pair_field"], data["label_field"])


def prepare_task(config: dict) -> Task:
    """Read, check and tokenize the train and validation examples: with the checkpoint's
    own tokenizer (tokenizer.json: its normalizer, specials and pair template, as
    transformers tokenizes for it) where it has one and data.vocab_file is not set, else
    BERT WordPiece over the vocab.txt."""
    data = config["data"]
    checkpoint = Path(resolve_asset(config["model"]["init_checkpoint"]))
    # The checkpoint's own tokenizer as transformers builds it: tokenizer.json, or a vocab.txt
    # with tokenizer_config.json (its do_lower_case: a cased model stays cased).
    own_tokenizer = data["vocab_file"] is None and (
        (checkpoint / "tokenizer.json").is_file() or (checkpoint / "tokenizer_config.json").is_file()
    )
    if own_tokenizer:
        from finetune.folder import folder_tokenizer, hands_token_types

        vocab_file, template = None, folder_tokenizer(checkpoint)
        token_types = hands_token_types(checkpoint)
    else:
        vocab_file = Path(resolve_asset(data["vocab_file"]) or checkpoint / "vocab.txt")
        if not vocab_file.is_file():
            raise FinetuneError(f"{vocab_file}: no vocabulary file (set data.vocab_file)")
        check_vocabulary(checkpoint, vocab_file)
        tokenizer, vocab = load_tokenizer(vocab_file)

    examples = read_examples(data, resolve_asset(data["train_file"]))
    for note in examples.notes:
        log.info("note: %s", note)
    if data["validation_file"] is None:
        train_rows, val_rows = split_by_seed(len(examples), data["validation_fraction"], data["split_seed"])
        train, validation = examples.subset(train_rows), examples.subset(val_rows)
    else:
        train, validation = examples, read_examples(data, data["validation_file"])
    label_names = data["labels"] or label_names_of(train)
    splits = []
    for name, part in (("train", train), ("validation", validation)):
        labels = encode_labels(part, label_names, data["multi_label"])
        length, too_long = data["max_sequence_length"], data["too_long"]
        if own_tokenizer:
            tokenized = tokenize_by_template(part, template, labels, length, too_long)
            if not token_types:  # the model is given zeros by transformers' tokenizer: the same here
                tokenized.segment_ids = [np.zeros_like(s) for s in tokenized.segment_ids]
        else:
            tokenized = tokenize(part, tokenizer, vocab, labels, length, too_long)
        if tokenized.truncated:
            log.warning(
                "%s: %d of %d examples truncated to %d tokens",
                name,
                tokenized.truncated,
                len(tokenized),
                data["max_sequence_length"],
            )
        splits.append(tokenized)
    return Task(splits[0], splits[1], label_names, vocab_file)


# ----- model and optimizer -----------------------------------------------------------------
def build_classifier(config: dict, task: Task):
    """The packed classifier over the checkpoint: this project's packed BERT for a BERT
    folder, transformers' own modules with packed attention for the other encoder
    families (model/families.py)."""
    model_cfg, data = config["model"], config["data"]
    checkpoint = resolve_asset(model_cfg["init_checkpoint"])
    torch.manual_seed(config["training"]["seed"])  # the classifier's init
    problem_type = "multi_label_classification" if data["multi_label"] else "single_label_classification"
    labels = {"id2label": dict(enumerate(task.label_names)),
              "label2id": {name: i for i, name in enumerate(task.label_names)}}  # fmt: skip
    options = ModelOptions(
        new_head=True,  # fine-tuning: the classifier may be new; the encoder must be whole
        attention_backend=model_cfg["attention_backend"],
        dropout={"hidden": model_cfg["hidden_dropout"], "attention": model_cfg["attention_dropout"],
                 "classifier": model_cfg["classifier_dropout"]},
        config={"num_labels": len(task.label_names), "problem_type": problem_type, **labels},
    )  # fmt: skip
    try:
        check_config_values(Path(checkpoint))  # sizes transformers would trip on, in one line
        opened = open_model(checkpoint, "classification", options)
        model, positions = opened.model, opened.max_tokens
    except UnsupportedFamily as err:
        raise FinetuneError(f"model.init_checkpoint {checkpoint}: {err}") from None
    except (OSError, ValueError, RuntimeError) as err:  # a missing, truncated or foreign folder
        if isinstance(err, FinetuneError):
            raise
        raise FinetuneError(
            f"model.init_checkpoint {checkpoint}: cannot be loaded ({first_line(err)[:300]})"
        ) from None
    longest = int(max(task.train.lengths.max(), task.validation.lengths.max()))
    if longest > positions:
        raise FinetuneError(
            f"data.max_sequence_length: examples of {longest} tokens exceed the checkpoint's {positions} positions"
        )
    return model


def build_adamw(model, optim: dict, total_steps: int):
    """AdamW without decay on biases and LayerNorm (optim.weight_decay_groups, the rule
    pretraining uses); linear warmup then linear decay to 0. The fused kernel (one pass
    over all parameters, on CPU and CUDA; what transformers' Trainer picks by default):
    torch's default for-loop AdamW was ~13% of a MiniLM step on 2 CPU cores."""
    optimizer = torch.optim.AdamW(
        weight_decay_groups(model.named_parameters(), optim["weight_decay"]),
        lr=optim["lr"],
        betas=tuple(optim["betas"]),
        eps=optim["eps"],
        fused=True,
    )
    warmup = max(1, math.ceil(optim["warmup_fraction"] * total_steps))

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ----- the run -----------------------------------------------------------------------------
def batching_spec(config: dict, batch_size: int) -> BatchingSpec:
    batching = config["batching"]
    return BatchingSpec(
        batching["mode"],
        batch_size,
        config["data"]["max_sequence_length"],
        batching["max_sequences_per_pack"],
        batching["algorithm"],
        batching["pad_last_batch"],
        batching["pack_length"],
    )


def finetune_step(model, batch, optimizer, scheduler, max_grad_norm: float) -> dict:
    """One optimizer step on one batch: mean loss over the batch's examples. -> sums."""
    model.train()
    out = model(**to_device(batch, next(model.parameters()).device))
    out["loss"].backward()
    if not bool(torch.isfinite(out["loss"])):
        optimizer.zero_grad(set_to_none=True)
        raise FinetuneError(
            f"non-finite training loss ({float(out['loss'].detach())}): the run diverged (lower optim.lr?)"
        )
    if max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, foreach=True)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {k: float(out[k]) for k in ("loss_sum", "count", "correct", "correct_count")}


@dataclass
class Job:
    """What the shared loop needs from a task (classification here, QA in finetune.qa_task):
    the training and validation rows (anything with token_ids, segment_ids, labels and
    lengths), the model, and how to evaluate, write and save."""

    train: object
    validation: object
    model: torch.nn.Module
    evaluate: object  # (model, eval batcher) -> (metrics dict, inference timing, outputs)
    write_outputs: object  # (output folder, outputs) -> None
    save: object  # (model, model folder) -> None
    description: str  # "5 classes" / "1,203 questions"


def classification_job(config: dict) -> Job:
    task = prepare_task(config)
    model = build_classifier(config, task)
    multi_label = config["data"]["multi_label"]

    def evaluate(model, batcher):
        logits, inference = predict_logits(model, task.validation, batcher)
        if not np.isfinite(logits).all():
            raise Diverged(
                "validation logits are not finite: the run diverged (lower optim.lr?); nothing saved"
            )
        return score(logits, task.validation.labels, multi_label), inference, logits

    return Job(
        task.train,
        task.validation,
        model,
        evaluate,
        lambda output, logits: write_predictions(
            output / "validation_predictions.jsonl", logits, task.label_names, multi_label
        ),
        lambda model, folder: save_finetuned(
            model,
            config,
            task.label_names,
            task.vocab_file,
            folder,
            tokenizer_source=Path(resolve_asset(config["model"]["init_checkpoint"])),
        ),  # fmt: skip
        f"{len(task.label_names)} classes",
    )


def qa_job(config: dict) -> Job:
    from finetune.qa_task import (
        answer_questions,
        answer_settings,
        build_qa_model,
        prepare_qa,
        score_answers,
        write_answer_files,
    )

    checkpoint = resolve_asset(config["model"]["init_checkpoint"])
    refusal = qa_fine_tuning_refusal(checkpoint)
    if refusal:
        raise FinetuneError(f"model.init_checkpoint {checkpoint}: {refusal}")
    vocab_file = Path(resolve_asset(config["data"]["vocab_file"]) or Path(checkpoint) / "vocab.txt")
    if not vocab_file.is_file():
        raise FinetuneError(f"{vocab_file}: no vocabulary file (set data.vocab_file)")
    check_vocabulary(Path(checkpoint), vocab_file)
    _, vocab = load_tokenizer(vocab_file)
    train, validation, tokenizer = prepare_qa(config, vocab, resolve_asset)
    model = build_qa_model(config, checkpoint)
    longest = int(max(train.windows.lengths.max(), validation.windows.lengths.max()))
    if longest > model.config.max_position_embeddings:
        raise FinetuneError(
            f"data.max_sequence_length: windows of {longest} tokens exceed the checkpoint's "
            f"{model.config.max_position_embeddings} positions"
        )
    qa = config["qa"]
    settings = answer_settings(qa)

    def evaluate(model, batcher):
        answers, inference = answer_questions(model, validation, batcher, settings)
        return score_answers(answers, validation.examples, qa["version_2_with_negative"]), inference, answers

    return Job(
        train.windows,
        validation.windows,
        model,
        evaluate,
        lambda output, answers: write_answer_files(
            output / "validation_predictions.json", answers, validation.examples
        ),
        lambda model, folder: save_finetuned(model, config, None, vocab_file, folder, tokenizer),
        f"{len(train.examples)} / {len(validation.examples)} questions",
    )


FEW_VALIDATION_EXAMPLES = 30  # below this, the run's summary says its validation score measures little


class Diverged(RuntimeError):
    """The weights or outputs stopped being finite; CLI exit code 3 (as pretraining's)."""


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM stopped the run; the message says what was kept."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


def check_positions(config: dict) -> None:
    """data.max_sequence_length must fit the checkpoint's position embeddings: checked from
    its config.json before any text is read, tokenized or packed."""
    checkpoint = Path(resolve_asset(config["model"]["init_checkpoint"]))
    config_file = checkpoint / "config.json"
    if not checkpoint.is_dir():
        raise FinetuneError(f"model.init_checkpoint {checkpoint}: no such folder")
    if not config_file.is_file():
        raise FinetuneError(
            f"model.init_checkpoint {checkpoint}: no config.json (not a Hugging Face model folder)"
        )
    try:
        described = json.loads(config_file.read_text())
        positions = described.get("max_position_embeddings", described.get("n_positions"))
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise FinetuneError(f"{config_file}: not a readable config ({err})") from None
    from model.families import usable_positions

    if isinstance(positions, int):
        positions = usable_positions(described.get("model_type"), positions, described.get("pad_token_id"))
    length = config["data"]["max_sequence_length"]
    if isinstance(positions, int) and length > positions:
        raise FinetuneError(
            f"data.max_sequence_length {length}: the checkpoint {checkpoint} has {positions} positions; "
            f"give at most {positions}"
        )


# What a run writes in its output folder (removed, and only these, by --overwrite).
RUN_FILES = ("model", "checkpoint", "summary.json", "metrics.jsonl", "validation_predictions.jsonl",
             "validation_predictions.json")  # fmt: skip


def clear_run(output: Path) -> None:
    """--overwrite: remove a previous run's files from `output` (RUN_FILES only: anything
    else in the folder, such as the data, is left alone)."""
    import shutil

    for name in RUN_FILES:
        path = output / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


# Settings a resumed run may change (none of them changes what is computed): the time budget,
# the threads, the progress bar. Everything else must equal the checkpoint's config.
CHANGEABLE_ON_RESUME = {("training", "max_seconds"), ("training", "threads"), ("training", "progress")}


def check_output(output: Path, resume: bool) -> dict | None:
    """The output folder may hold nothing finished; --resume needs its checkpoint. -> the
    checkpoint's progress (resume) or None."""
    from finetune.checkpoint import checkpoint_path, read_progress

    if (output / "summary.json").exists() or (output / "model").exists():
        raise FinetuneError(
            f"--output-dir {output}: holds a finished run; choose another folder, or --overwrite to replace it"
        )
    try:
        progress = read_progress(output)
    except ValueError as err:
        raise FinetuneError(
            f"--resume: {err}; the checkpoint is damaged: start over with --overwrite"
        ) from None
    if resume and progress is None:
        raise FinetuneError(f"--resume: {checkpoint_path(output)} holds no checkpoint to resume from")
    if not resume and progress is not None:
        raise FinetuneError(
            f"--output-dir {output}: holds an unfinished run (checkpoint at epoch {progress['epoch']}); "
            "continue it with --resume, replace it with --overwrite, or choose another folder"
        )
    return progress


def run_finetune(
    config: dict, output: Path, resume: bool = False, stop=None, overwrite: bool = False
) -> dict:
    """Train, evaluate each epoch, time inference, save. Returns the summary.

    resume: continue from OUTPUT/checkpoint (finetune.checkpoint). stop: an object whose
    is_set() is polled after every step (the CLI's SIGINT/SIGTERM flag); when set, the run
    writes a checkpoint and raises Interrupted."""
    from finetune.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint, weights_finite

    check_positions(config)  # before anything is read, packed or (--overwrite) removed
    if overwrite and not resume:
        clear_run(output)
    progress = check_output(output, resume)
    changed = sorted(
        f"{section}.{key}" for section in config for key in config[section]
        if progress is not None and (section, key) not in CHANGEABLE_ON_RESUME
        and progress["config"].get(section, {}).get(key) != config[section][key]
    )  # fmt: skip
    if changed:
        raise FinetuneError(
            f"--resume: the config differs from the checkpoint's in {', '.join(changed) or 'its sections'}; "
            "resume with the same config"
        )
    training = config["training"]
    if training["threads"]:
        torch.set_num_threads(training["threads"])
    if training["device"] == "cuda" and not torch.cuda.is_available():
        from common.cli import no_gpu

        raise FinetuneError(no_gpu("training.device cuda", torch.__version__, torch.version.cuda is not None))
    job = qa_job(config) if config["data"]["task"] == "question_answering" else classification_job(config)
    output.mkdir(parents=True, exist_ok=True)
    model = job.model.to(training["device"])
    seed = config["batching"]["shuffle_seed"]
    batcher = Batcher(job.train.lengths, batching_spec(config, config["batching"]["batch_size"]), seed)
    steps_per_epoch = batcher.batches_per_epoch
    optimizer, scheduler = build_adamw(model, config["optim"], training["epochs"] * steps_per_epoch)
    eval_batcher = Batcher(
        job.validation.lengths, batching_spec(config, config["batching"]["eval_batch_size"]), seed
    )
    log.info(
        "%s batching: %d train / %d validation rows, %s, %d steps per epoch, %.2f per packed row",
        batcher.spec.mode,
        len(job.train),
        len(job.validation),
        job.description,
        steps_per_epoch,
        batcher.packing_factor,
    )
    torch.manual_seed(training["seed"] + 1)  # dropout stream, independent of the head's init
    keys = ("loss_sum", "count", "correct", "correct_count")
    data_digest = input_digest(config)
    state = {"epoch": 0, "batches_done": 0, "sums": dict.fromkeys(keys, 0.0), "steps": 0,
             "train_seconds": 0.0, "train_examples": 0, "padding": [], "config": config}  # fmt: skip
    state["data_sha256"] = data_digest
    if progress is not None:
        try:
            state = load_checkpoint(output, model, optimizer, scheduler)
        except Exception as err:  # noqa: BLE001 - safetensors, torch.load and the state dicts each raise their own
            raise FinetuneError(
                f"--resume: {checkpoint_path(output)} is damaged ({type(err).__name__}: {first_line(err)[:200]}); "
                "start over with --overwrite"
            ) from None
        if state.get("data_sha256", data_digest) != data_digest:
            raise FinetuneError(
                f"--resume: the training or validation data changed since the checkpoint (same paths, other "
                f"contents: {', '.join(k for k in data_digest if state['data_sha256'].get(k) != data_digest[k])}); "
                "resume with the data it was trained on, or start over with --overwrite"
            )
        state["config"] = config  # the same but for CHANGEABLE_ON_RESUME: the new budget is recorded
        log.info(
            "resumed from %s: epoch %d, %d batches done in it",
            checkpoint_path(output),
            state["epoch"],
            state["batches_done"],
        )
    metrics_path = output / "metrics.jsonl"
    kept = []  # metrics lines of the epochs the checkpoint has validated
    if progress is not None and metrics_path.is_file():
        kept = [
            line
            for line in metrics_path.read_text().splitlines()
            if json.loads(line)["epoch"] < state["epoch"]
        ]
    stopped, validation, inference, outputs = False, None, None, None

    def diverged_check(epoch: int) -> None:
        if not weights_finite(model):
            raise Diverged(
                f"epoch {epoch}: the weights are no longer finite: the run diverged (lower optim.lr?); nothing saved"
            )

    if stop is not None and stop.is_set():
        raise Interrupted("stopped before the first step; nothing was trained", stop.signum)
    last_epoch = state["epoch"] if state.get("finished") else training["epochs"]
    with metrics_path.open("w") as metrics_file:
        metrics_file.write("".join(line + "\n" for line in kept))
        metrics_file.flush()
        for epoch in range(state["epoch"], last_epoch):
            batches = batcher.epoch(epoch)
            if state["batches_done"] == 0:
                state["padding"].append(batcher.padding_fraction(batches))
            sums = state["sums"]
            bar = tqdm(batches, desc=f"epoch {epoch}", disable=not training["progress"], leave=False,
                       initial=state["batches_done"])  # fmt: skip
            for table in batches[state["batches_done"] :]:
                start = time.perf_counter()
                batch = collate(job.train, table, batcher.width(table))
                try:
                    step = finetune_step(model, batch, optimizer, scheduler, config["optim"]["max_grad_norm"])
                except FinetuneError as err:
                    raise Diverged(
                        f"epoch {epoch}, step {state['steps'] + 1}: {err}; nothing saved"
                    ) from None
                state["train_seconds"] += time.perf_counter() - start
                state["steps"] += 1
                state["batches_done"] += 1
                state["train_examples"] += int(step["count"])
                for key in sums:
                    sums[key] += float(step[key])
                bar.update(1)
                if stop is not None and stop.is_set() and state["batches_done"] < len(batches):
                    bar.close()
                    diverged_check(epoch)
                    where = save_checkpoint(output, model, optimizer, scheduler, {**state, "epoch": epoch})
                    raise Interrupted(
                        f"stopped at epoch {epoch}, step {state['steps']}; checkpoint kept at {where}: "
                        "continue with the same command and --resume", stop.signum
                    )  # fmt: skip
                if training["max_seconds"] is not None and state["train_seconds"] >= training["max_seconds"]:
                    stopped = True
                    break
            bar.close()
            diverged_check(epoch)
            # Timed inference in the same batching mode; the last epoch's pass (the model does
            # not change after it) is the run's inference figure and its predictions.
            validation, inference, outputs = job.evaluate(model, eval_batcher)
            record = {
                "epoch": epoch,
                "step": state["steps"],
                "train_loss": sums["loss_sum"] / max(sums["count"], 1),
                "train_accuracy": sums["correct"] / max(sums["correct_count"], 1),
                **{f"validation_{k}": v for k, v in validation.items()},
            }
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            log.info(
                "epoch %d: %s", epoch, {k: round(v, 4) for k, v in record.items() if isinstance(v, float)}
            )
            finished = stopped or epoch + 1 == training["epochs"]
            state.update(epoch=epoch + 1, batches_done=0, sums=dict.fromkeys(keys, 0.0), finished=finished)
            save_checkpoint(output, model, optimizer, scheduler, state)
            if stopped:
                log.info("stopped after training.max_seconds=%s", training["max_seconds"])
                break
    if validation is None:  # resumed from the last epoch's checkpoint: nothing left to train
        validation, inference, outputs = job.evaluate(model, eval_batcher)
    job.write_outputs(output, outputs)
    save_final(job, model, output)
    summary = {
        "task": config["data"]["task"],
        "batching": batcher.spec.mode,
        "train_examples": state["train_examples"],
        "train_steps": state["steps"],
        "train_seconds": state["train_seconds"],
        "train_examples_per_second": state["train_examples"] / max(state["train_seconds"], 1e-9),
        "train_padding_fraction": float(np.mean(state["padding"])),
        "examples_per_row": batcher.packing_factor,
        "inference_examples_per_second": inference["examples_per_second"],
        "inference_padding_fraction": inference["padding_fraction"],
        "inference_seconds": inference["seconds"],
        "truncated": job.train.truncated + job.validation.truncated,
        "validation_examples": len(job.validation.lengths),
        **{f"validation_{k}": v for k, v in validation.items()},
    }
    if len(job.validation.lengths) < FEW_VALIDATION_EXAMPLES:  # say it, rather than a bare 0.0 or 1.0
        log.info(
            "validation: %d examples; a score over so few measures little (give data.validation_file, or more data)",
            len(job.validation.lengths),
        )
    write_json_atomic(output / "summary.json", summary)
    return summary


def save_final(job, model, output: Path) -> None:
    """The model folder predict reads; a failed save (no space, a file-size limit) is one
    line naming the folder and the checkpoint that is kept, never a traceback."""
    from safetensors import SafetensorError

    from finetune.checkpoint import checkpoint_path, read_progress

    try:
        job.save(model, output / "model")
    except (OSError, SafetensorError, RuntimeError) as err:
        kept = checkpoint_path(output)
        progress = read_progress(output) if kept.is_dir() else None
        what = (
            f"the checkpoint of epoch {progress['epoch'] - 1} is kept at {kept}: free the space and run the "
            "same command with --resume to save it"
            if progress is not None
            else "no checkpoint was written"
        )
        reason = describe_os_error(err) if isinstance(err, OSError) else first_line(err)[:200]
        raise FinetuneError(
            f"{output / 'model'}: the final model could not be saved ({reason}); {what}"
        ) from None


def main(argv=None) -> int:
    import signal
    import threading

    parser = command_parser("python -m finetune.train", __doc__)
    parser.add_argument("--config", required=True, help="fine-tuning YAML (see configs/README.md)")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument(
        "--resume", action="store_true", help="continue the run in --output-dir from its checkpoint (exactly)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a previous run in --output-dir (its files only)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    quiet_transformers()

    # SIGINT / SIGTERM: the loop finishes its step, keeps a checkpoint and ends in one line.
    stop = threading.Event()
    stop.signum = 0

    def request_stop(signum, frame):
        stop.signum = signum
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        config = load_finetune_config(args.config, args.set)
        if args.resume and args.overwrite:
            raise FinetuneError(
                "--resume continues the run in --output-dir, --overwrite replaces it: give one"
            )
        summary = run_finetune(
            config, args.output_dir, resume=args.resume, stop=stop, overwrite=args.overwrite
        )
    except (ConfigError, ExampleError, DataInputError, FinetuneError, PackingInputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: {describe_os_error(err)}", file=sys.stderr)
        return 2
    except Diverged as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except Interrupted as err:
        print(f"interrupted: {err}", file=sys.stderr)
        return 128 + err.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stop.is_set():  # a signal after the last step: the run finished and is complete
        log.info("a stop was asked for after the last step; the run is complete")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
