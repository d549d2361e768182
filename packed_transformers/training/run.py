"""BERT's pretraining run: the same for every engine (engines: torch, pipeline, ipu), a job of
the pretraining runs' one Trainer (components.trainer: the setup's order, resume, checkpoints).

    setup: data checked -> engine, model checked against the data -> output folder -> the
           checkpoint's weights -> engine.attach (its optimizer state) -> run state -> loader
    loop:  micro-batches from the resumable loader  ->  engine.step (one place for the
           step's math: components.step)  ->  log window  ->  evaluation when due  ->
           checkpoint when due  ->  stop on max_steps / max_samples / max_seconds / signal
    end:   evaluation at the end, final checkpoint, MLPerf RUN_STOP

A batch goes: packed shard rows (components.data) -> dict of [B, S] / [B, M] / [B, K] int
tensors -> engine -> PackedBertForPreTraining -> sums and counts -> loss normalised by
the step's GLOBAL masked-token and sequence counts -> backward -> LAMB step.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from packed_transformers.components import run_checkpoint as ckpt_run
from packed_transformers.components.batch_check import validate_batch
from packed_transformers.components.data import (
    PackedShards,
    ReplicaSampler,
    advance,
    eval_batches,
    make_loader,
    padded_groups,
)
from packed_transformers.components.errors import RunError
from packed_transformers.components.loop import LoopEnd
from packed_transformers.components.observe import MetricSums, summarize
from packed_transformers.components.run_folder import CHANGEABLE_ON_RESUME, check_same_run, data_identity
from packed_transformers.components.run_state import (
    BertProgress,
    Diverged,
    EvalSchedule,
    RunState,
    skip_or_stop,
)
from packed_transformers.components.step import NonFiniteStep
from packed_transformers.components.synthetic import SyntheticPacks
from packed_transformers.components.trainer import PretrainingTrainer, Resumed
from packed_transformers.engines.engine import Engine, PretrainingLoss
from packed_transformers.training.build import (
    build_model,
    build_schedule,
    check_model_fits_data,
    mlperf_eval_interval,
    open_packed,
    packing_factor,
)

log = logging.getLogger("training")

# What may change on resume: what CHANGEABLE_ON_RESUME allows, and the split of the global batch
# over processes and accumulation (checked against the checkpoint: the packs a step stay)
GLOBAL_BATCH_SPLIT = CHANGEABLE_ON_RESUME | {("optim", "gradient_accumulation")}


class Run(PretrainingTrainer):
    """BERT's pretraining run on this process, on the engine the config selects: the phases of
    components.trainer.Trainer's setup (every user-input check before config.yaml is written),
    then what a step, a logging window, an evaluation and a checkpoint are."""

    progress_type = BertProgress
    changeable = GLOBAL_BATCH_SPLIT

    def __init__(self, config: dict, output: Path, resume: bool, engine_class: type[Engine]):
        self.engine_class = engine_class
        super().__init__(config, output, resume)

    # ----- the setup's phases (components.trainer) ---------------------------------------
    def open_data(self) -> None:
        """The train data (None when synthetic) and the eval data (or None), each checked against
        the config (S, K, shard names, sizes, counts, sha256)."""
        data = self.config["data"]
        self.train_data = None if data["synthetic"] else open_packed(data["train_dir"], self.config, "train")
        self.data_identity = data_identity(self.config)  # metadata.json's sha256, hashed once
        self.eval_data = open_packed(data["eval_dir"], self.config, "eval") if data["eval_dir"] else None

    def build(self) -> None:
        """The engine (this process's place), the model, checked against the data (the eval data
        too: not hours in, at the first evaluation)."""
        self.engine = self.engine_class(self.config)
        self.rank = self.engine.rank
        self.loss = PretrainingLoss(self.config["model"]["mlm_loss_mode"])  # what every engine's step takes
        self.model = build_model(self.config, self.limits["seed"])
        if self.train_data is None:
            self.train_data = self._synthetic_packs()
        check_model_fits_data(self.model, self.train_data)
        if self.eval_data is not None:
            check_model_fits_data(self.model, self.eval_data, "data.eval_dir")

    def _synthetic_packs(self) -> SyntheticPacks:
        """data.synthetic: random well-formed packs, made for this model's vocabulary."""
        data = self.config["data"]
        if self.rank == 0:
            log.warning("data.synthetic: random packs, no data read; throughput check only")
        return SyntheticPacks(data["max_sequence_length"], data["max_sequences_per_pack"],
                              data["synthetic_packing_factor"], self.model.config.vocab_size, data["shuffle_seed"])  # fmt: skip

    def load_checkpoint(self, path: Path, saved: dict) -> None:
        """The weights, before the engine attaches (the pipeline and IPU engines place and adapt
        the model there); the optimizer's state once it has (attach)."""
        ckpt_run.load_model_weights(self.model, path)

    def attach(self, resumed: Resumed | None) -> None:
        # What the step is made of, after the packing adjustment (components.step.BatchArithmetic).
        self.arithmetic = self.engine.attach(self.model, packing_factor(self.train_data))
        self.schedule = build_schedule(self.config)
        if resumed is not None:  # its dcp/ where a sharded run wrote one
            self.engine.load_state(resumed.saved, resumed.path)

    def make_eval_schedule(self) -> EvalSchedule:
        every = self.config["eval"]["every_samples"] or mlperf_eval_interval(
            self.arithmetic.sequences_per_step
        )
        return EvalSchedule(int(every))

    def check_resume(self, path: Path, restored: RunState) -> None:
        """The checkpoint's own record, not only config.yaml (which a user can delete or edit):
        the same settings, the same global batch, the same data at the data path."""
        config, kept = self.config, restored.extra
        if kept.config is not None:
            check_same_run(kept.config, config, "the checkpoint", changeable=GLOBAL_BATCH_SPLIT)
            # the global batch may be split another way (other processes, other accumulation:
            # a sharded run resumed on another number of ranks), never changed: the checkpoint
            # records its packs a step (one from before that record: the same accumulation)
            written = kept.packs_per_step
            accumulation = kept.config["optim"]["gradient_accumulation"]
            if written is None and accumulation != config["optim"]["gradient_accumulation"]:
                raise RunError(
                    "--resume: optim.gradient_accumulation differs from the checkpoint's, which does not "
                    "record its packs a step (written before they were recorded): keep it"
                )
            if written is not None and written != self.arithmetic.packs_per_step:
                raise RunError(
                    f"--resume: the checkpoint's steps are {written} packs, this run's "
                    f"{self.arithmetic.packs_per_step} (processes x optim.gradient_accumulation x "
                    "data.micro_batch_packs): the global batch must stay"
                )
        before, now = kept.data_identity, self.data_identity
        if before is not None and before != now:
            raise RunError(
                f"--resume: {config['data']['train_dir']}/metadata.json has sha256 {str(now)[:12]}..., "
                f"the checkpoint was trained on {before[:12]}...: the data at data.train_dir changed "
                "(re-packed or replaced) since; resume on the data it was trained on, or start a new run"
            )

    def record_progress(self, progress: BertProgress) -> None:
        progress.config, progress.data_identity = self.config, self.data_identity
        progress.packs_per_step = self.arithmetic.packs_per_step

    def open_position(self) -> None:
        """This replica's resumable iterator of micro-batches from the state's position; this
        replica's part of the evaluation set."""
        data, engine, vocab = self.config["data"], self.engine, self.model.config.vocab_size
        self.shards = (
            self.train_data
            if data["synthetic"]
            else PackedShards(self.train_data, vocab, self.model.config.type_vocab_size)
        )
        try:
            self.sampler = ReplicaSampler(len(self.shards), self.arithmetic.micro_batch_packs, data["shuffle_seed"],
                                          engine.data_rank, engine.data_world, self.state.extra.position)  # fmt: skip
        except ValueError as err:
            raise RunError(f"data.micro_batch_packs {self.arithmetic.micro_batch_packs}: {err}") from None
        self.loader = iter(make_loader(self.shards, self.sampler, data["loader_workers"]))
        eval_set = None  # (shards, this replica's batches, sequences)
        if self.eval_data:
            eval_set = eval_batches(self.eval_data, self.arithmetic.micro_batch_packs,
                                    self.config["eval"]["max_sequences"], engine.data_rank, engine.data_world, vocab)  # fmt: skip
        self.eval_set = eval_set[:2] if eval_set else None
        self.eval_sequences = eval_set[2] if eval_set else 0

    def start_reporting(self) -> None:
        """MLPerf's init lines, the progress bar."""
        config, engine = self.config, self.engine
        self.reporter.mlperf.init(config, platform_name(config, engine), self.init_started_ms, self.arithmetic,
                                  train_samples=self.train_data.sequences, eval_samples=self.eval_sequences)  # fmt: skip
        # One bar, in the unit of what ends the run: steps when only max_steps bounds it;
        # else the percentage of whichever limit (steps, samples, a time budget) is nearest,
        # so its ETA is the run's (a 20 s budget never shows a 28-hour ETA over 100,000 steps).
        self.budget_limits = binding_limits(self.limits)
        self.progress = tqdm(
            total=self.limits["max_steps"] if not self.budget_limits else 100,
            initial=self.state.step if not self.budget_limits else 0,
            unit="step" if not self.budget_limits else "%",
            desc=None if not self.budget_limits else "of " + " / ".join(self.budget_limits) + ", nearest",
            dynamic_ncols=True,
            disable=engine.rank != 0 or not config["logging"]["progress"],
        )

    def snapshot(self):
        return self.engine.snapshot()

    def compile(self) -> int:
        """--compile-only: the engine compiles from one call's micro-batches (and one
        evaluation call's), timed; nothing trains, nothing is written to the run folder."""
        micro_batches = [next(self.loader) for _ in range(self.engine.micro_batches_per_call)]
        eval_group = None
        if self.eval_set is not None:
            shards, batches = self.eval_set
            size = self.engine.eval_group_size()
            eval_group = next(
                padded_groups(shards, batches, size, self.arithmetic.micro_batch_packs, groups=1)
            )
        times = self.engine.compile(micro_batches, eval_group)
        if self.engine.rank == 0:
            log.info("compile only: %s", ", ".join(f"{k} graph {v:.1f} s" for k, v in times.items()))
        return 0

    # ----- the loop (components.loop.run_loop decides when; these methods say what) ------
    def begin(self) -> None:
        if self.engine.rank == 0:
            log.info(self.arithmetic.adjusted.describe())
            log.info(
                "%s; eval every %d sequences", self.arithmetic.describe(), self.eval_schedule.every_samples
            )
        self.lr = None
        self._new_window()

    @property
    def steps_per_call(self) -> int:
        return self.engine.steps_per_call

    def log_due(self) -> bool:
        step = self.state.step
        return (
            step % self.limits["log_every_steps"] < self.engine.steps_per_call
            or step >= self.limits["max_steps"]
        )

    def flush_window(self) -> None:
        if self.window_samples and self.lr is not None:
            self.log_window()

    def evaluates_at_end(self) -> bool:
        return bool(self.config["eval"]["at_end"]) and self.eval_set is not None

    def train_call(self) -> None:
        """One engine call: its micro-batches, the lr for the samples so far (self.lr), the
        steps it makes; advances the run state."""
        state, engine = self.state, self.engine
        micro_batches = [next(self.loader) for _ in range(engine.micro_batches_per_call)]
        if self.config["data"]["validate_batches"]:
            for batch in micro_batches:
                validate_batch(batch, self.model.config.vocab_size, self.model.config.max_position_embeddings)
        self.lr = self.schedule(state.samples)
        try:
            result = engine.step(micro_batches, self.loss, self.lr)
            for sums in result.kept:  # the step passed: its metric sums join the logging window
                self.window.add_vector(sums)
            counts = result.units
        except NonFiniteStep as err:  # the budget is the run's, kept in checkpoints: --resume keeps it
            state.skipped_steps += 1
            self.window_skipped += 1
            skip_or_stop(f"step {state.step + 1}", err, state.skipped_steps, self.limits["on_nonfinite"],
                         self.limits["max_skipped_steps"])  # fmt: skip
            counts = torch.zeros(2)  # a skipped step: its data is consumed, nothing learned
        sequences = int(counts[1].item())
        state.step += engine.steps_per_call
        state.samples += sequences
        self.window_samples += sequences
        state.extra.position = advance(
            state.extra.position, engine.micro_batches_per_call * engine.data_world, self.sampler.per_epoch
        )
        self._show_progress(engine.steps_per_call)

    def _show_progress(self, steps: int) -> None:
        """Advance the bar: by steps, or to the fraction of the nearest limit (start_reporting)."""
        if not self.budget_limits:
            self.progress.update(steps)
            return
        state, limits = self.state, self.limits
        fractions = [state.step / limits["max_steps"]]
        if limits["max_samples"] is not None:
            fractions.append(state.samples / limits["max_samples"])
        if limits["max_train_seconds"] is not None:
            fractions.append(self.train_seconds() / limits["max_train_seconds"])
        if limits["max_seconds"] is not None:
            fractions.append((time.perf_counter() - self.started) / limits["max_seconds"])
        self.progress.n = round(min(1.0, max(fractions)) * 100, 1)
        self.progress.refresh()

    # ----- reporting -------------------------------------------------------------------
    def _new_window(self) -> None:
        self.window, self.window_start, self.window_samples = MetricSums(), self.train_seconds(), 0
        self.window_skipped = 0

    def log_window(self) -> None:
        totals = self.engine.reduce(self.window)
        figures = summarize(totals)
        if not math.isfinite(figures["loss"]):  # engines that cannot check per step
            raise Diverged(f"step {self.state.step}: non-finite loss in the last logging window")
        if figures["sequences"] == 0 and self.window_skipped:
            # Every step of the window was skipped: no figure to report (a 0.0 loss would
            # read as perfect), only that it was skipped.
            figures = {key: None for key in figures} | {"sequences": 0, "masked_tokens": 0}
        now = self.train_seconds()
        seconds = now - self.window_start
        record = {
            "step": self.state.step,
            "samples": self.state.samples,
            "train_seconds": now,
            "epoch": self.state.extra.position.epoch,
            "lr": self.lr,
            **figures,
            "sequences_per_second": self.window_samples / seconds,
            "tokens_per_second": totals["tokens"] / seconds,
        }
        if self.window_skipped:
            record["skipped_steps"] = self.window_skipped
        self.reporter.log(record)
        if record["loss"] is None:
            self._new_window()
            return
        self.progress.set_postfix(
            loss=f"{record['loss']:.3f}",
            mlm_acc=f"{record['mlm_accuracy']:.3f}",
            seq_s=f"{record['sequences_per_second']:.1f}",
            tok_s=f"{record['tokens_per_second']:.0f}",
        )
        self._new_window()

    def evaluate(self) -> bool:
        """Evaluate, log; True when the target MLM accuracy is reached."""
        if self.eval_set is None:
            return False
        state = self.state
        train_seconds = self.train_seconds()
        with self._paused():
            metrics = self.engine.evaluate(*self.eval_set)
        state.extra.best_eval_accuracy = max(state.extra.best_eval_accuracy, metrics["mlm_accuracy"])
        record = {"step": state.step, "samples": state.samples, "train_seconds": train_seconds, **metrics}
        self.reporter.log(record, "eval")
        self.reporter.mlperf.evaluation(state.samples, metrics["mlm_accuracy"])
        if self.engine.rank == 0:
            self.progress.write(
                f"eval at {state.samples} sequences: MLM accuracy {metrics['mlm_accuracy']:.4f} "
                f"over {metrics['masked_tokens']} masked tokens of {metrics['sequences']} sequences"
            )
        return metrics["mlm_accuracy"] >= self.config["eval"]["target_mlm_accuracy"]

    def end_figures(self) -> dict:
        return {"train_seconds": self.train_seconds()}

    def close(self, end: LoopEnd) -> None:
        self.state.reached_target = end.stopped_by == "target"
        self.progress.close()
        super().close(end)


def run(config: dict, output: Path, resume: bool) -> int:
    """The run with the engine the config selects, as a process exit code: user-input and
    environment errors become exit code 2 with one line (run_pretraining.py's contract)."""
    from packed_transformers.components.run_state import exit_code_of
    from packed_transformers.engines import engine_class

    return exit_code_of(lambda: run_training(config, output, resume, engine_class(config)))


def run_training(
    config: dict, output: Path, resume: bool = False, engine_class: type[Engine] | None = None
) -> int:
    """The whole run on this process with `engine_class` (default: the torch engine).
    The engine's config checks come first, before any data is opened or hashed.
    Returns the process exit code."""
    if engine_class is None:
        from packed_transformers.engines.torch_engine import TorchEngine

        engine_class = TorchEngine
    engine_class.check_config(config)
    run = Run(config, output, resume, engine_class)
    return run.compile() if run.compile_only else run.train()


def binding_limits(limits: dict) -> list[str]:
    """The limits besides max_steps that may end the run first (names as in the config)."""
    return [
        name for name in ("max_samples", "max_train_seconds", "max_seconds") if limits.get(name) is not None
    ]


def platform_name(config: dict, engine) -> str:
    """'<processes>x<device>' for the MLPerf log's submission_platform default."""
    device = config["execution"]["device"]
    if device == "cuda":
        device = torch.cuda.get_device_name().replace(" ", "_")
    return f"{engine.data_world}x{device}"
