"""Fine-tune a checkpoint with packed (or padded) batches: text classification, extractive
question answering, a decoder's supervised fine-tuning.

    python -m packed_transformers.finetune.train --config configs/finetune_bbc.yaml --output-dir runs/bbc \
        [--set batching.mode=dynamic ...]
    torchrun --nproc-per-node N -m packed_transformers.finetune.train ... [--set execution.sharding=fsdp]

A task's examples, checked and tokenized (finetune.jobs) -> batch tables (packs.batching:
padded | dynamic | uniform | packed) -> the task's packed model -> its loss -> AdamW step; after
every epoch the validation set through inference in the same batching mode, timed, the last
pass's predictions written. Under torchrun the processes share each step's rows, the model
replicated (DDP) or sharded (FSDP2): components.replicas; rank 0 writes.

Where things live: finetune.specs (the task's job, picked once), finetune.jobs (each task's
data, model, evaluation and save), finetune.run_folder and finetune.checkpoint (the output
folder, resume's checks, the checkpoint's files). This module: `Run`, a job of the one Trainer
(components.trainer) driven by the one loop (components.loop.run_loop).

OUTPUT/  model/ (a transformers folder for predict), metrics.jsonl (a line per epoch),
         validation_predictions.jsonl (QA: .json), summary.json (examples/s, padding, scores)
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # option and path mistakes answered before torch is imported
    from packed_transformers.common.preflight import exit_on_path_mistakes
    from packed_transformers.finetune.config import exit_on_config_mistakes, train_parser

    early = train_parser(__doc__).parse_args()  # --help, a mistyped or missing option: exits here
    exit_on_path_mistakes({"--config": "config"})
    exit_on_config_mistakes(early)  # its keys, model.init_checkpoint's folder

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from packed_transformers.common.cli import first_line, refuse
from packed_transformers.common.config_schema import ConfigError
from packed_transformers.common.files import describe_os_error, release_folder, write_json_atomic
from packed_transformers.components import replicas as parallel  # this process among the run's
from packed_transformers.components import run_checkpoint as ckpt_run
from packed_transformers.components.checkpoint import CheckpointError, weights_writer
from packed_transformers.components.errors import RunError
from packed_transformers.components.loop import LoopEnd, run_loop
from packed_transformers.components.run_folder import lock_run_folder
from packed_transformers.components.run_state import Diverged, EvalSchedule, RunState, skip_or_stop
from packed_transformers.components.step import NonFiniteStep, weights_finite
from packed_transformers.components.trainer import Resumed, Trainer
from packed_transformers.data.assets import resolve_asset
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.data.tokenizer import DataInputError
from packed_transformers.door.folder import check_positions
from packed_transformers.engines.torch_engine import TorchEngine
from packed_transformers.finetune.checkpoint import (
    KEEP,
    FinetuneProgress,
    checkpoints_folder,
    zero_sums,
)
from packed_transformers.finetune.config import load_finetune_config, train_parser
from packed_transformers.finetune.errors import FinetuneError, Interrupted
from packed_transformers.finetune.job_contract import SLOT_LOSS, Job
from packed_transformers.finetune.jobs import prepare_task, read_examples
from packed_transformers.finetune.run_folder import (
    check_output,
    clear_run,
    input_digest,
    resume_differences,
    save_final,
)
from packed_transformers.finetune.specs import FinetuneSpec, spec_for
from packed_transformers.hf_integration.rerank_train import RerankStopped  # a reranker stopped by a signal
from packed_transformers.model.hf_checkpoint import quiet_transformers
from packed_transformers.optim import build_adamw
from packed_transformers.packs.batching import Batcher, BatchingSpec
from packed_transformers.packs.errors import PackingInputError

log = logging.getLogger("finetune")

# What the command answers in one line and exit 2: the input's fault, found before or while it runs.
REFUSED = (ConfigError, ExampleError, DataInputError, FinetuneError, PackingInputError, CheckpointError,
           RunError)  # fmt: skip
FEW_VALIDATION_EXAMPLES = 30  # below this, the run's summary says its validation score measures little


# ----- the step ----------------------------------------------------------------------------
def batching_spec(config: dict, batch_size: int) -> BatchingSpec:
    batching, compiled = config["batching"], config["training"]["compile"]
    # a compiled step keeps one shape: the last batch gets empty rows (they hold no example)
    return BatchingSpec(batching["mode"], batch_size, config["data"]["max_sequence_length"],
                        batching["max_sequences_per_pack"], batching["algorithm"],
                        batching["pad_last_batch"] or compiled, batching["pack_length"])  # fmt: skip


def finetune_step(
    engine: TorchEngine, batch: dict, lr: float, loss=SLOT_LOSS, replicas=parallel.ONE_PROCESS
) -> dict:
    """One optimizer step on this process's rows of one batch (the engine's step; a bare TorchStep
    takes it alike, as the benches' do): the mean loss over the step's examples (or predicted
    tokens) of every process. -> the step's sums over every process: STEP_SUMS. NonFiniteStep
    for a non-finite one (weights untouched)."""
    return replicas.step_sums(engine.step([batch], loss, lr).kept[0])  # one process: its own sums


# ----- the run: a job of every run's one Trainer (components.trainer) -----------------------
class Run(Trainer):
    """A fine-tuning run on this process: the phases of components.trainer.Trainer's setup (the
    input read and checked once before anything is built; the resume checkpoint read once), then
    what the loop (components.loop.run_loop) asks: a step is a batch, an evaluation an epoch's
    validation (its metrics line: no per-step lines, no target), a checkpoint after each, the
    limits the epochs and training.max_seconds."""

    progress_type = FinetuneProgress
    metrics_file = None  # OUTPUT/metrics.jsonl, open while the loop runs (rank 0's)
    batches = None  # the epoch in progress's batch tables
    bar = None  # its progress bar
    validated = None  # the last validation: (metrics, inference timing, outputs)
    summary = None  # written by close at a complete end
    where = None  # the newest checkpoint's folder
    # (the weights gathered whole: rank 0's, else None,) of the checkpoint at the run's limit, for the
    # final save not to gather them again; None before it. Every rank holds the tuple or None alike.
    final_weights = None
    undertrained = None  # why it ended before its epochs' steps (its summary says it)

    def __init__(self, config: dict, output: Path, resume: bool, stop=None, overwrite: bool = False,
                 spec: FinetuneSpec | None = None):  # fmt: skip
        # stop: a components.run_state.StopSignal (or anything with is_set() and signum), or None;
        # spec: the job the command picked (finetune.specs; None: the config's data.task's)
        self.given_stop, self.overwrite, self.spec = stop, overwrite, spec or spec_for(config)
        super().__init__(config, output, resume)

    @property
    def model(self) -> torch.nn.Module:
        """The weights (sharded in place under FSDP2): the engine's."""
        return self.engine.model

    # ----- the setup's phases (components.trainer) ---------------------------------------
    def open_data(self) -> None:
        """The config's positions checked, this process among the run's (torchrun:
        components.replicas), the output folder and the config checked against its checkpoint
        (read once), the task's input read and checked and batched (the batchers check the rows
        against the config): every check before anything is built or (--overwrite) removed."""
        config = self.config
        checkpoint_config = check_positions(
            Path(resolve_asset(config["model"]["init_checkpoint"])), config["data"]["max_sequence_length"]
        )  # before anything is read or (--overwrite) removed
        self.replicas = parallel.join_replicas(*(config["execution"][k] for k in ("device", "sharding", "threads")))  # fmt: skip
        self.rank = self.replicas.rank
        if not self.replicas.writes:
            log.setLevel(logging.WARNING)  # rank 0 tells the run; the others say what goes wrong
        lock_run_folder(self.output, self.rank)  # before --overwrite removes a thing; given back at the end
        replacing = self.overwrite and not self.resume  # the old run goes, once this one's input is checked
        self.found = None
        if not replacing:
            ckpt_run.remove_half_written(checkpoints_folder(self.output), self.rank)
            self.found = check_output(self.output, self.resume)  # the checkpoint --resume continues from
            changed = resume_differences(config, self.found and self.found.progress)
            if changed:
                raise FinetuneError(f"--resume: the config differs from the checkpoint's in {', '.join(changed)}; "
                                    "resume with the same config")  # fmt: skip
        self.job_input = self.spec.read_input(config, checkpoint_config)  # config.json once
        seed, batching = config["batching"]["shuffle_seed"], config["batching"]
        spec_of = self.job_input.batching or batching_spec
        self.batcher = Batcher(self.job_input.train.lengths, spec_of(config, batching["batch_size"]), seed)
        self.eval_batcher = Batcher(self.job_input.validation.lengths, spec_of(config, batching["eval_batch_size"]),
                                    seed)  # fmt: skip
        self.digests = input_digest(config)
        if replacing:  # a bad input line above keeps the run it would have replaced
            if self.replicas.writes:
                clear_run(self.output)
            ckpt_run.remove_half_written(checkpoints_folder(self.output), self.rank)

    def build(self) -> None:
        """The task's model (nothing of it built before the input was whole), placed, sharded
        or replicated; AdamW and its schedule; the step (fp32)."""
        config, replicas, training = self.config, self.replicas, self.config["training"]
        self.job = self.job_input.build()
        self.output.mkdir(parents=True, exist_ok=True)
        self.skeleton = parallel.host_skeleton(self.job.model, replicas)  # before it moves or is sharded
        steps = training["epochs"] * self.batcher.batches_per_epoch

        def adamw(placed):  # over the placed (sharded) parameters; the schedule in optimizer steps
            optimizer, self.schedule = build_adamw(placed, config["optim"], steps)
            return optimizer

        self.engine = TorchEngine(config, replicas)
        self.engine.place(self.job.model.to(replicas.device), adamw, "fp32", training["compile"],
                          config["optim"]["max_grad_norm"])  # fmt: skip
        batcher, job, batching = self.batcher, self.job, config["batching"]
        log.info(
            "%s batching: %d train / %d validation rows, %s, %d steps per epoch, %.2f per packed row%s%s",
            batcher.spec.mode, len(job.train), len(job.validation), job.description, batcher.batches_per_epoch,
            batcher.packing_factor, batcher.packing_note(batching["max_sequences_per_pack"]), replicas.describe(),
        )  # fmt: skip
        torch.manual_seed(training["seed"] + 1)  # dropout stream, independent of the head's init

    def prepare_folder(self, resume: bool) -> None:  # locked and checked in open_data; no config.yaml
        pass

    def read_checkpoint(self) -> Resumed:
        """--resume: the weights, optimizer and RNG of the newest intact checkpoint whose weights
        load (components.checkpoint.resume_from over the points check_output read, any number of
        ranks having written it), its run state; the learning rate follows from the step."""
        state = RunState(extra=self.new_progress())  # the checkpoint's, once restored into it
        try:
            path, _ = ckpt_run.restore(checkpoints_folder(self.output), self.load_checkpoint, self.parts(state),
                                       self.found.points)  # fmt: skip
        except CheckpointError as err:
            raise FinetuneError(f"--resume: {first_line(err)[:300]}; start over with --overwrite") from None
        return Resumed(path, state, None)

    def load_checkpoint(self, path: Path, saved: dict) -> None:
        self.engine.restore(path, saved)  # strict; sharded: this rank's shards

    def make_eval_schedule(self) -> EvalSchedule:
        return EvalSchedule(per_epoch=True)  # every fine-tuning run validates each epoch

    def new_progress(self) -> FinetuneProgress:
        return FinetuneProgress(self.config, self.digests)

    def check_resume(self, path: Path, restored: RunState) -> None:
        """Refused where the data or the tokenizer changed since the checkpoint."""
        kept = restored.extra.data_sha256 or self.digests  # a checkpoint from before they were kept
        kept_tokenizer = kept.get("tokenizer")  # absent: a checkpoint from before it was kept
        if kept_tokenizer is not None and kept_tokenizer != self.digests["tokenizer"]:
            raise FinetuneError(
                "--resume: the tokenizer's files changed since the checkpoint (model.init_checkpoint's tokenizer "
                "files or data.vocab_file: same paths, other contents); the planned batches came from the old "
                "tokenizer: restore it, or start over with --overwrite"
            )
        changed = ", ".join(k for k in self.digests if k != "tokenizer" and kept.get(k) != self.digests[k])
        if changed:
            raise FinetuneError(
                f"--resume: the training or validation data changed since the checkpoint (same paths, other "
                f"contents: {changed}); resume with the data it was trained on, or start over with --overwrite"
            )

    def resumed_line(self, path: Path) -> str:
        progress = self.state.extra
        return f"resumed from {path}: epoch {progress.epoch}, {progress.batches_done} batches done in it"

    def record_progress(self, progress: FinetuneProgress) -> None:
        # the same config but for CHANGEABLE_ON_RESUME: the new budget is recorded
        progress.config = self.config
        progress.data_sha256 = progress.data_sha256 or self.digests  # a checkpoint from before it was kept

    def open_records(self, resumed: bool) -> None:
        """Interrupted for a stop asked for before the first step (nothing written); else rank 0's
        OUTPUT/metrics.jsonl opened for the loop, holding the lines of the epochs the checkpoint
        has validated (a resumed run's; none for a new one)."""
        self.stop = stop = self.given_stop
        if stop is not None and stop.is_set():
            raise Interrupted("stopped before the first step; nothing was trained", stop.signum)
        if self.replicas.writes:
            path, epoch = self.output / "metrics.jsonl", self.state.extra.epoch
            lines = path.read_text().splitlines() if epoch > 0 and path.is_file() else []
            kept = "".join(line + "\n" for line in lines if json.loads(line)["epoch"] < epoch)
            self.metrics_file = path.open("w")
            self.metrics_file.write(kept)
            self.metrics_file.flush()

    # ----- the loop's questions ------------------------------------------------------------
    def limit_reached(self) -> str | None:
        state, training = self.state, self.config["training"]
        if state.extra.finished or state.extra.epoch >= training["epochs"]:
            return "epochs"
        # every rank stops at the same step: one whose clock reached the budget stops all
        if training["max_seconds"] is not None and self.replicas.agree(
            state.train_seconds >= training["max_seconds"]
        ):
            return "max_seconds"
        return None

    def train_call(self) -> None:
        """One batch of the epoch in progress: its optimizer step, the run state advanced.
        Diverged (components.run_state) for a non-finite step."""
        state, epoch = self.state, self.state.extra.epoch
        if self.batches is None:  # the epoch starts (or resumes at state.extra.batches_done)
            self.batches = self.batcher.epoch(epoch)
            if state.extra.batches_done == 0:
                state.extra.padding.append((self.job.padding or self.batcher.padding_fraction)(self.batches))
            self.bar = tqdm(self.batches, desc=f"epoch {epoch}", disable=not self.config["training"]["progress"],
                            leave=False, initial=state.extra.batches_done)  # fmt: skip
        table = self.batches[state.extra.batches_done]
        start = time.perf_counter()
        rows = self.replicas.rows(table, self.batcher.spec.pad_last_batch)  # this process's share of the step
        batch = self.job.collate(self.job.train, rows, self.batcher.width(table))
        try:
            step = finetune_step(self.engine, batch, self.schedule(state.step), self.job.loss, self.replicas)
        except NonFiniteStep as err:
            skip_or_stop(f"epoch {epoch}, step {state.step + 1}", err, 1)  # raises Diverged
        state.train_seconds += time.perf_counter() - start
        state.step += 1
        state.extra.batches_done += 1
        state.samples += int((table >= 0).sum())
        for key in state.extra.sums:
            state.extra.sums[key] += float(step[key])
        self.bar.update(1)

    def epoch_in_progress(self) -> tuple[int, int] | None:
        return None if self.batches is None else (self.state.extra.batches_done, len(self.batches))

    def evaluate(self) -> bool:
        """The epoch in progress validated (also one a time budget cut short), its metrics line
        written, the next epoch begun. -> False: fine-tuning has no target to stop at."""
        epoch = self.state.extra.epoch
        if self.bar is not None:
            self.bar.close()
        check_weights(self, epoch)  # every rank: a collective
        if self.replicas.writes or self.replicas.sharded:  # a sharded forward needs every rank
            self.validated = validate_epoch(self, epoch, self.metrics_file)
        progress = self.state.extra
        progress.epoch, progress.batches_done, progress.sums = epoch + 1, 0, zero_sums()
        self.batches = self.bar = None
        return False

    def evaluates_at_end(self) -> bool:  # an epoch a time budget stopped: validated as a whole one is
        return self.state.extra.batches_done > 0

    def checkpoint_due(self) -> bool:
        return self.batches is None and self.state.extra.batches_done == 0  # after each epoch's validation

    def write_checkpoint(self) -> None:
        """The checkpoint of this step (sharded: every rank's shards in dcp/, the weights gathered
        whole for model/; any number of ranks resumes it); a run whose limit is reached is marked finished (a
        --resume of it trains nothing more). OSError or CheckpointError, on every rank."""
        self.state.extra.finished = self.limit_reached() is not None
        snapshot = self.engine.snapshot(save_whole=weights_writer(self.model, None))  # sharded: dcp/
        self.where = ckpt_run.write_checkpoint(
            checkpoints_folder(self.output), self.parts(self.state), KEEP, snapshot, self.rank
        )
        self.final_weights = (snapshot.weights,) if self.state.extra.finished else None

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
        if end.exit_code:
            raise Interrupted(
                f"stopped at epoch {self.state.extra.epoch}, step {self.state.step}; checkpoint kept at {self.where}: "
                "continue with the same command and --resume", self.stop.signum
            )  # fmt: skip
        # a time limit ends a run short (this one, or the one --resume found finished)
        training = self.config["training"]
        if self.state.step < (planned := training["epochs"] * self.batcher.batches_per_epoch):
            self.undertrained = (f"stopped by training.max_seconds={training['max_seconds']} after {self.state.step:,} of "
                                 f"{planned:,} steps: the model is undertrained (give more seconds, or fewer examples)")  # fmt: skip
        if self.validated is None and (self.replicas.writes or self.replicas.sharded):
            self.validated = self.job.evaluate(self.model, self.eval_batcher)  # a resumed finished run
        # sharded: the weights the checkpoint of this step gathered, else (a resumed finished run)
        # gathered now, a collective every rank enters alike
        kept, failure = self.final_weights if self.saved_step == self.state.step else None, None
        weights = kept[0] if kept is not None else parallel.gathered_weights(self.model, self.replicas)
        if self.replicas.writes:
            model = self.model if self.skeleton is None else parallel.whole_model(self.skeleton, weights)
            try:
                self.summary = finish_run(self, model, *self.validated)
            except (FinetuneError, OSError) as err:  # every rank ends with it, none waits for rank 0
                failure = err
        if self.replicas.agree(failure is not None):  # the run's files are complete when any rank returns
            raise failure or FinetuneError("rank 0 could not write the run's outputs (its line says why)")


def run_finetune(config: dict, output: Path, resume: bool = False, stop=None, overwrite: bool = False,
                 spec: FinetuneSpec | None = None) -> dict:  # fmt: skip
    """Train, evaluate each epoch, time inference, save. Returns the summary.

    resume: continue from OUTPUT/checkpoints (finetune.checkpoint). stop: an object whose
    is_set() is polled after every step (the CLI's SIGINT/SIGTERM flag); when set, the run
    writes a checkpoint and raises Interrupted. spec: the job (finetune.specs; None: data.task's)."""
    try:
        run = Run(config, output, resume, stop, overwrite, spec)  # checked, built, restored (--resume)
        run_loop(run)
    finally:  # the folder's lock, for a later run in this process's lifetime or another's
        release_folder(output)
    return run.summary


def check_weights(run: Run, epoch: int) -> None:
    if run.replicas.agree(not weights_finite(run.model.parameters())):  # sharded: every rank's shards
        raise Diverged(f"epoch {epoch}: the weights are no longer finite: the run diverged (lower optim.lr?); "
                       "nothing saved")  # fmt: skip


def validate_epoch(run: Run, epoch: int, metrics_file):
    """Timed inference over the validation set in the run's batching mode, its metrics line
    written. The last epoch's pass (the model does not change after it) is the run's
    inference figure and its predictions. -> (metrics, inference timing, outputs)."""
    validation, inference, outputs = run.job.evaluate(run.model, run.eval_batcher)
    sums = run.state.extra.sums
    record = {
        "epoch": epoch,
        "step": run.state.step,
        "train_loss": sums["loss_sum"] / max(sums["count"], 1),
        "train_accuracy": sums["correct"] / max(sums["correct_count"], 1),
        **{f"validation_{k}": v for k, v in validation.items()},
    }
    if metrics_file is not None:  # rank 0's
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
    log.info("epoch %d: %s", epoch, {k: round(v, 4) for k, v in record.items() if isinstance(v, float)})
    return validation, inference, outputs


def finish_run(run: Run, model, validation: dict, inference: dict, outputs) -> dict:
    """Write the predictions, the model folder (of `model`: the run's, or a sharded run's
    gathered whole) and summary.json. -> the summary."""
    job, state, output = run.job, run.state, run.output
    job.write_outputs(output, outputs)
    save_final(job, model, output)
    summary = {
        "task": run.config["data"]["task"],
        "batching": run.batcher.spec.mode,
        "train_examples": state.samples,
        "train_steps": state.step,
        "train_seconds": state.train_seconds,
        "train_examples_per_second": state.samples / max(state.train_seconds, 1e-9),
        "train_padding_fraction": float(np.mean(state.extra.padding)),
        "examples_per_row": run.batcher.packing_factor,
        "inference_examples_per_second": inference["examples_per_second"],
        "inference_padding_fraction": inference["padding_fraction"],
        "inference_seconds": inference["seconds"],
        "truncated": job.train.truncated + job.validation.truncated,
        "validation_examples": len(job.validation.lengths),
        **{f"validation_{k}": v for k, v in validation.items()},
        **({"undertrained": run.undertrained} if run.undertrained else {}),
    }
    if len(job.validation.lengths) < FEW_VALIDATION_EXAMPLES:  # say it, rather than a bare 0.0 or 1.0
        log.info(
            "validation: %d examples; a score over so few measures little (give data.validation_file, or more data)",
            len(job.validation.lengths),
        )
    write_json_atomic(output / "summary.json", summary)
    return summary


# Names other modules and the benches import from here.
__all__ = ["Diverged", "FinetuneError", "Interrupted", "Job", "Run", "batching_spec", "build_adamw", "finetune_step",
           "prepare_task", "read_examples", "resolve_asset", "run_finetune"]  # fmt: skip


def main(argv=None) -> int:
    from packed_transformers.components.distributed import shut_down_process_group
    from packed_transformers.components.run_state import StopSignal

    parser = train_parser(__doc__)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    quiet_transformers(args.verbose)
    stop = StopSignal()  # SIGINT / SIGTERM: the loop finishes its step, keeps a checkpoint, one line
    try:
        config = load_finetune_config(args.config, args.set)
        if args.resume and args.overwrite:
            raise FinetuneError(
                "--resume continues the run in --output-dir, --overwrite replaces it: give one"
            )
        spec = spec_for(config)  # the job, picked once
        summary = spec.run(config, args.output_dir, args.resume, stop, args.overwrite, spec)
    except REFUSED as err:
        return refuse(err)
    except OSError as err:
        return refuse(describe_os_error(err))
    except Diverged as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except (Interrupted, RerankStopped) as err:
        print(f"interrupted: {err}", file=sys.stderr)
        return 128 + err.signum
    finally:
        stop.restore()
        shut_down_process_group()
    if summary is None:  # a torchrun rank but the first: rank 0 wrote and prints the run
        return 0
    if stop.is_set():  # a signal after the last step: the run finished and is complete
        log.info("a stop was asked for after the last step; the run is complete")
    print(json.dumps(summary, indent=1))
    if summary.get("undertrained"):  # the last line a user reads, not the first of many
        print(f"warning: {summary['undertrained']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
