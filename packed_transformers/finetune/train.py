"""Fine-tune a BERT checkpoint for text classification or extractive question answering
with packed (or padded) batches.

    python -m packed_transformers.finetune.train --config configs/finetune_bbc.yaml --output-dir runs/bbc \
        [--set batching.mode=dynamic ...]

Data flow (classification): examples (jsonl or BBC News) -> labels checked -> WordPiece
ids -> train / validation split -> batch tables (inference.batching: padded | dynamic |
uniform | packed) -> collate -> PackedBertForSequenceClassification -> per-example loss
-> AdamW step. Question answering (data.task: question_answering, finetune.qa_task):
SQuAD questions -> overlapping context windows with span labels -> the same batch tables
and step -> PackedBertForQuestionAnswering. After every epoch the validation set goes
through inference in the same batching mode, timed; the last pass's predictions are
written (classification in input order; QA as SQuAD's {question id: answer} file).
Causal LM (data.task: causal_lm, finetune.causal_lm_task): prompt/completion JSON lines
-> a decoder's packed causal LM, the loss on the completion's tokens only.

Where things live: finetune.jobs (each task's data, model, evaluation and save: `JOBS`),
finetune.run_folder (the output folder, --overwrite, --resume's checks, the final save),
finetune.run_folder (`RunState`: a checkpoint's progress), finetune.checkpoint (its files).
This module: the optimizer, the step, and the run: start_run builds it, the one training loop
of every run (components.loop.run_loop) drives it (`Run`: a step is a batch, an evaluation an
epoch's validation, a checkpoint after each), finish_run writes its outputs.

OUTPUT/
  model/                      Hugging Face folder (+ vocab.txt, finetune.json) for predict
  metrics.jsonl               one line per epoch: train loss/accuracy, validation metrics
  validation_predictions.jsonl   classification; QA: validation_predictions.json
  summary.json                mode, examples/s (training, inference), padding fractions, accuracy
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # option and path mistakes answered before torch is imported
    from packed_transformers.common.preflight import exit_on_path_mistakes
    from packed_transformers.finetune.config import train_parser

    train_parser(__doc__).parse_args()  # --help, a mistyped or missing option: exits here

    exit_on_path_mistakes({"--config": "file"})

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from packed_transformers.common.cli import first_line, refuse
from packed_transformers.common.config_schema import ConfigError
from packed_transformers.common.files import describe_os_error, write_json_atomic
from packed_transformers.components.checkpoint import CheckpointError
from packed_transformers.components.loop import LoopEnd, LoopJobDefaults, run_loop
from packed_transformers.components.step import NonFiniteStep, check_finite_step, weights_finite
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.data.tokenizer import DataInputError
from packed_transformers.finetune.config import load_finetune_config, train_parser
from packed_transformers.finetune.errors import Diverged, FinetuneError, Interrupted
from packed_transformers.finetune.job_contract import Job, classification_sums, resolve_asset
from packed_transformers.finetune.jobs import JOBS, prepare_task, read_examples
from packed_transformers.finetune.run_folder import (
    RunState,
    check_output,
    check_positions,
    clear_run,
    input_digest,
    resume_differences,
    save_final,
    zero_sums,
)
from packed_transformers.inference.batching import Batcher, BatchingSpec
from packed_transformers.inference.predictions import to_device
from packed_transformers.model.hf_checkpoint import quiet_transformers
from packed_transformers.optim import WarmupLinearDecay, weight_decay_groups
from packed_transformers.packs.errors import PackingInputError
from packed_transformers.packs.tokenized import wider_packs

log = logging.getLogger("finetune")

FEW_VALIDATION_EXAMPLES = 30  # below this, the run's summary says its validation score measures little


# ----- optimizer and step ------------------------------------------------------------------
def build_adamw(model, optim: dict, total_steps: int):
    """AdamW without decay on biases and LayerNorm (optim.weight_decay_groups, the rule
    pretraining uses); optim.WarmupLinearDecay in optimizer steps. The fused kernel (one pass
    over all parameters, on CPU and CUDA; what transformers' Trainer picks by default):
    torch's default for-loop AdamW was ~13% of a MiniLM step on 2 CPU cores."""
    optimizer = torch.optim.AdamW(
        weight_decay_groups(model.named_parameters(), optim["weight_decay"]),
        lr=optim["lr"],
        betas=tuple(optim["betas"]),
        eps=optim["eps"],
        fused=True,
    )
    schedule = WarmupLinearDecay(
        optim["lr"], max(1, math.ceil(optim["warmup_fraction"] * total_steps)), total_steps
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule.fraction(step))


# ----- the run -----------------------------------------------------------------------------
def batching_spec(config: dict, batch_size: int) -> BatchingSpec:
    batching = config["batching"]
    return BatchingSpec(
        batching["mode"],
        batch_size,
        config["data"]["max_sequence_length"],
        batching["max_sequences_per_pack"],
        batching["algorithm"],
        # a compiled step keeps one shape: the last batch gets empty rows (they hold no example)
        batching["pad_last_batch"] or config["training"]["compile"],
        batching["pack_length"],
    )


# What training.compile hands torch.compile (tests count compilations through another backend).
COMPILE_BACKEND = "inductor"


def step_model_of(model: torch.nn.Module, compile_step: bool):
    """The module the training step calls: `model` itself, or (training.compile) its compiled
    forward with static shapes, built at the first step and reused by every batch of the run
    (FIXED_WIDTH_MODES give each batch the same rows x width). Its backward is compiled with
    it (AOTAutograd); weights, optimizer and checkpoints stay `model`'s."""
    if not compile_step:
        return model
    return torch.compile(model, backend=COMPILE_BACKEND, dynamic=False)


def finetune_step(model, batch, optimizer, scheduler, max_grad_norm: float, sums=classification_sums,
                  step_model=None) -> dict:  # fmt: skip
    """One optimizer step on one batch (the model's mean loss). -> `sums(outputs)`: STEP_SUMS.
    step_model: what runs the forward (step_model_of; None: `model`)."""
    model.train()
    step_model = model if step_model is None else step_model
    out = step_model(**to_device(batch, next(model.parameters()).device))
    out["loss"].backward()
    # the divergence rule of every training run (components.step): a non-finite loss or
    # gradient norm stops the run before the optimizer moves the weights
    try:
        norm = check_finite_step(out["loss"], model.parameters(), check_gradients=True)
    except NonFiniteStep as err:
        optimizer.zero_grad(set_to_none=True)
        raise FinetuneError(f"non-finite training step ({err}): the run diverged (lower optim.lr?)") from None
    if max_grad_norm > 0 and norm is not None:  # clipped by the norm just checked
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_grad_norm, norm, foreach=True)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return sums(out, batch)


# ----- the run: a job of the one training loop (components.loop) ---------------------------
@dataclass
class Run(LoopJobDefaults):
    """What a run works with, built once by start_run; `state` changes as it trains. The
    loop (components.loop.run_loop) asks it when and does what its methods say: a step is a
    batch, an evaluation is an epoch's validation (its metrics line: no per-step lines, no
    target), a checkpoint follows each validation, the limits are the epochs and
    training.max_seconds."""

    config: dict
    output: Path
    job: Job
    model: torch.nn.Module
    batcher: Batcher
    eval_batcher: Batcher
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    state: RunState
    stop: object  # has is_set() and signum (the CLI's signal flag), or None
    step_model: torch.nn.Module  # what the training step calls: model, or compiled (step_model_of)
    saved_step: int | None = None  # the newest checkpoint's step (a resume's: not written again)
    metrics_file: object = None  # OUTPUT/metrics.jsonl, open while the loop runs
    batches: list | None = None  # the epoch in progress's batch tables
    bar: object = None  # its progress bar
    validated: tuple | None = None  # the last validation: (metrics, inference timing, outputs)
    summary: dict | None = None  # written by close at a complete end
    where: Path | None = None  # the newest checkpoint's folder

    @property
    def step(self) -> int:
        return self.state.steps

    def limit_reached(self) -> str | None:
        state, training = self.state, self.config["training"]
        if state.finished or state.epoch >= training["epochs"]:
            return "epochs"
        if training["max_seconds"] is not None and state.train_seconds >= training["max_seconds"]:
            return "max_seconds"
        return None

    def train_call(self) -> None:
        """One batch of the epoch in progress: its optimizer step, the run state advanced.
        Diverged (components.run_state) for a non-finite step."""
        state, epoch = self.state, self.state.epoch
        if self.batches is None:  # the epoch starts (or resumes at state.batches_done)
            self.batches = self.batcher.epoch(epoch)
            if state.batches_done == 0:
                state.padding.append(self.batcher.padding_fraction(self.batches))
            self.bar = tqdm(self.batches, desc=f"epoch {epoch}", disable=not self.config["training"]["progress"],
                            leave=False, initial=state.batches_done)  # fmt: skip
        table = self.batches[state.batches_done]
        start = time.perf_counter()
        batch = self.job.collate(self.job.train, table, self.batcher.width(table))
        try:
            step = finetune_step(self.model, batch, self.optimizer, self.scheduler,
                                 self.config["optim"]["max_grad_norm"], self.job.step_sums, self.step_model)  # fmt: skip
        except FinetuneError as err:
            raise Diverged(f"epoch {epoch}, step {state.steps + 1}: {err}; nothing saved") from None
        state.train_seconds += time.perf_counter() - start
        state.steps += 1
        state.batches_done += 1
        state.train_examples += int((table >= 0).sum())
        for key in state.sums:
            state.sums[key] += float(step[key])
        self.bar.update(1)

    def evaluation_due(self) -> bool:
        return self.batches is not None and self.state.batches_done == len(self.batches)

    def evaluate(self) -> bool:
        """The epoch in progress validated (also one a time budget cut short), its metrics line
        written, the next epoch begun. -> False: fine-tuning has no target to stop at."""
        epoch = self.state.epoch
        if self.bar is not None:
            self.bar.close()
        self.validated = validate_epoch(self, epoch, self.metrics_file)
        self.state.epoch, self.state.batches_done, self.state.sums = epoch + 1, 0, zero_sums()
        self.batches = self.bar = None
        return False

    def evaluates_at_end(self) -> bool:
        return self.state.batches_done > 0  # an epoch a time budget stopped: validated as a whole one is

    def checkpoint_due(self) -> bool:
        return self.batches is None and self.state.batches_done == 0  # after each epoch's validation

    def save(self) -> None:
        """The checkpoint of this step, never of non-finite weights; a run whose limit is reached
        is marked finished (a --resume of it trains nothing more)."""
        from packed_transformers.finetune.checkpoint import save_checkpoint

        check_weights(self, self.state.epoch)
        self.state.finished = self.limit_reached() is not None
        self.where = save_checkpoint(
            self.output, self.model, self.optimizer, self.scheduler, self.state.progress()
        )

    def stop_agreed(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def close(self, end: LoopEnd) -> None:
        """Diverged and Interrupted raised with their line; a complete run's outputs written."""
        if self.bar is not None:
            self.bar.close()
        if self.metrics_file is not None:
            self.metrics_file.close()
        if end.stopped_by == "error":  # an exception is on its way out: let it
            return
        if end.diverged:
            raise Diverged(end.diverged)
        if end.stopped_by == "max_seconds":
            log.info("stopped after training.max_seconds=%s", self.config["training"]["max_seconds"])
        if end.exit_code:
            raise Interrupted(
                f"stopped at epoch {self.state.epoch}, step {self.state.steps}; checkpoint kept at {self.where}: "
                "continue with the same command and --resume", self.stop.signum
            )  # fmt: skip
        if self.validated is None:  # resumed from the last epoch's checkpoint: nothing left to train
            self.validated = self.job.evaluate(self.model, self.eval_batcher)
        self.summary = finish_run(self, *self.validated)


def run_finetune(
    config: dict, output: Path, resume: bool = False, stop=None, overwrite: bool = False
) -> dict:
    """Train, evaluate each epoch, time inference, save. Returns the summary.

    resume: continue from OUTPUT/checkpoints (finetune.checkpoint). stop: an object whose
    is_set() is polled after every step (the CLI's SIGINT/SIGTERM flag); when set, the run
    writes a checkpoint and raises Interrupted."""
    run = start_run(config, output, resume, stop, overwrite)
    if stop is not None and stop.is_set():
        raise Interrupted("stopped before the first step; nothing was trained", stop.signum)
    open_metrics(run)
    run_loop(run)
    return run.summary


def open_metrics(run: Run) -> None:
    """OUTPUT/metrics.jsonl opened for the loop, holding the lines of the epochs the
    checkpoint has validated (a resumed run's; none for a new one)."""
    path, epoch = run.output / "metrics.jsonl", run.state.epoch
    lines = path.read_text().splitlines() if epoch > 0 and path.is_file() else []
    kept = "".join(line + "\n" for line in lines if json.loads(line)["epoch"] < epoch)
    run.metrics_file = path.open("w")
    run.metrics_file.write(kept)
    run.metrics_file.flush()


def start_run(config: dict, output: Path, resume: bool, stop, overwrite: bool) -> Run:
    """Check the output folder and the config against a checkpoint, build the task's job, the
    batchers and the optimizer, and restore the checkpoint's state (--resume)."""
    checkpoint_config = check_positions(config)  # before anything is read, packed or (--overwrite) removed
    if overwrite and not resume:
        clear_run(output)
    progress = check_output(output, resume)
    changed = resume_differences(config, progress)
    if changed:
        raise FinetuneError(
            f"--resume: the config differs from the checkpoint's in {', '.join(changed)}; resume with the same config"
        )
    training = config["training"]
    if training["threads"]:
        torch.set_num_threads(training["threads"])
    if training["device"] == "cuda" and not torch.cuda.is_available():
        from packed_transformers.common.cli import no_gpu

        raise FinetuneError(no_gpu("training.device cuda", torch.__version__, torch.version.cuda is not None))
    job = JOBS[config["data"]["task"]](config, checkpoint_config)  # config.json read once, handed on
    output.mkdir(parents=True, exist_ok=True)
    model = job.model.to(training["device"])
    seed, batching = config["batching"]["shuffle_seed"], config["batching"]
    batcher = Batcher(job.train.lengths, batching_spec(config, batching["batch_size"]), seed)
    optimizer, scheduler = build_adamw(model, config["optim"], training["epochs"] * batcher.batches_per_epoch)
    eval_batcher = Batcher(job.validation.lengths, batching_spec(config, batching["eval_batch_size"]), seed)
    log.info(
        "%s batching: %d train / %d validation rows, %s, %d steps per epoch, %.2f per packed row%s",
        batcher.spec.mode, len(job.train), len(job.validation), job.description,
        batcher.batches_per_epoch, batcher.packing_factor, packing_note(batcher, batching["max_sequences_per_pack"]),
    )  # fmt: skip
    torch.manual_seed(training["seed"] + 1)  # dropout stream, independent of the head's init
    state = RunState(config, input_digest(config))
    if progress is not None:
        state = restore_state(output, model, optimizer, scheduler, state)
    step_model = step_model_of(model, training["compile"])
    saved_step = state.steps if progress is not None else None
    return Run(config, output, job, model, batcher, eval_batcher, optimizer, scheduler, state, stop, step_model,
               saved_step)  # fmt: skip


def packing_note(batcher: Batcher, asked: int | None) -> str:
    """ ", K=16 (chosen from the lengths), 1.0% padding" for packed batching; "" otherwise."""
    if batcher.spec.mode != "packed":
        return ""
    how = "chosen from the lengths" if asked is None else f"at most {asked}"
    padding = batcher.padding_fraction([batcher.table])  # every pack of an epoch, in any order
    note = f", K={batcher.table.shape[1]} ({how}), {padding:.1%} padding"
    if batcher.spec.pack_length is None:  # the default width: say where a wider one would pad less
        wider = wider_packs(batcher.lengths, batcher.spec.fixed_width, padding)
        if wider is not None:
            note += (
                f" (packs of {wider.pack_length} tokens would leave {wider.padding:.1%}: "
                f"set batching.pack_length: {wider.pack_length})"
            )
    return note


def restore_state(output: Path, model, optimizer, scheduler, fresh: RunState) -> RunState:
    """--resume: the checkpoint's weights, optimizer, schedule and RNG into place (the newest
    intact one whose weights load: components.checkpoint.resume_from). -> its state; refused
    (one line) where none is left or the data changed."""
    from packed_transformers.finetune.checkpoint import load_checkpoint

    try:
        path, progress = load_checkpoint(output, model, optimizer, scheduler)
    except CheckpointError as err:
        raise FinetuneError(f"--resume: {first_line(err)[:300]}; start over with --overwrite") from None
    # the same config but for CHANGEABLE_ON_RESUME: the new budget is recorded
    state = RunState.from_progress(progress, fresh.config, fresh.data_sha256)
    kept_tokenizer = state.data_sha256.get("tokenizer")  # absent: a checkpoint from before it was kept
    if kept_tokenizer is not None and kept_tokenizer != fresh.data_sha256["tokenizer"]:
        raise FinetuneError(
            "--resume: the tokenizer's files changed since the checkpoint (model.init_checkpoint's tokenizer "
            "files or data.vocab_file: same paths, other contents); the planned batches came from the old "
            "tokenizer: restore it, or start over with --overwrite"
        )
    data_keys = [k for k in fresh.data_sha256 if k != "tokenizer"]
    if any(state.data_sha256.get(k) != fresh.data_sha256[k] for k in data_keys):
        changed = ", ".join(k for k in data_keys if state.data_sha256.get(k) != fresh.data_sha256[k])
        raise FinetuneError(
            f"--resume: the training or validation data changed since the checkpoint (same paths, other "
            f"contents: {changed}); resume with the data it was trained on, or start over with --overwrite"
        )
    log.info("resumed from %s: epoch %d, %d batches done in it", path, state.epoch,
             state.batches_done)  # fmt: skip
    return state


def check_weights(run: Run, epoch: int) -> None:
    if not weights_finite(run.model.parameters()):
        raise Diverged(f"epoch {epoch}: the weights are no longer finite: the run diverged (lower optim.lr?); "
                       "nothing saved")  # fmt: skip


def validate_epoch(run: Run, epoch: int, metrics_file):
    """Timed inference over the validation set in the run's batching mode, its metrics line
    written. The last epoch's pass (the model does not change after it) is the run's
    inference figure and its predictions. -> (metrics, inference timing, outputs)."""
    check_weights(run, epoch)
    validation, inference, outputs = run.job.evaluate(run.model, run.eval_batcher)
    sums = run.state.sums
    record = {
        "epoch": epoch,
        "step": run.state.steps,
        "train_loss": sums["loss_sum"] / max(sums["count"], 1),
        "train_accuracy": sums["correct"] / max(sums["correct_count"], 1),
        **{f"validation_{k}": v for k, v in validation.items()},
    }
    metrics_file.write(json.dumps(record) + "\n")
    metrics_file.flush()
    log.info("epoch %d: %s", epoch, {k: round(v, 4) for k, v in record.items() if isinstance(v, float)})
    return validation, inference, outputs


def finish_run(run: Run, validation: dict, inference: dict, outputs) -> dict:
    """Write the predictions, the model folder and summary.json. -> the summary."""
    job, state, output = run.job, run.state, run.output
    job.write_outputs(output, outputs)
    save_final(job, run.model, output)
    summary = {
        "task": run.config["data"]["task"],
        "batching": run.batcher.spec.mode,
        "train_examples": state.train_examples,
        "train_steps": state.steps,
        "train_seconds": state.train_seconds,
        "train_examples_per_second": state.train_examples / max(state.train_seconds, 1e-9),
        "train_padding_fraction": float(np.mean(state.padding)),
        "examples_per_row": run.batcher.packing_factor,
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


# Names other modules and the benches import from here.
__all__ = ["Diverged", "FinetuneError", "Interrupted", "Job", "batching_spec", "build_adamw", "finetune_step",
           "prepare_task", "read_examples", "resolve_asset", "run_finetune"]  # fmt: skip


def main(argv=None) -> int:
    import signal
    import threading

    parser = train_parser(__doc__)
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
    except (
        ConfigError,
        ExampleError,
        DataInputError,
        FinetuneError,
        PackingInputError,
        CheckpointError,
    ) as err:
        return refuse(err)
    except OSError as err:
        return refuse(describe_os_error(err))
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
