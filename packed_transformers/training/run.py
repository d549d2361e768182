"""The run: the same for every engine (engines: torch, pipeline, ipu).

    checks (data, output folder, model)  ->  engine.attach  ->  restore a checkpoint
    loop:  micro-batches from the resumable loader  ->  engine.train (one place for the
           step's math: components.step)  ->  log window  ->  evaluation when due  ->
           checkpoint when due  ->  stop on max_steps / max_samples / max_seconds / signal
    end:   evaluation at the end, final checkpoint, MLPerf RUN_STOP

A batch goes: packed shard rows (components.data) -> dict of [B, S] / [B, M] / [B, K] int
tensors -> engine -> PackedBertForPreTraining -> sums and counts -> loss normalised by
the step's GLOBAL masked-token and sequence counts -> backward -> LAMB step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

import torch

from packed_transformers.components import checkpoint as ckpt
from packed_transformers.components import run_checkpoint as ckpt_run
from packed_transformers.components.batch_check import validate_batch
from packed_transformers.components.data import advance, padded_groups
from packed_transformers.components.errors import RunError
from packed_transformers.components.loop import LoopEnd, PretrainingJob
from packed_transformers.components.observe import MetricSums, summarize
from packed_transformers.components.run_state import Diverged, skip_or_stop
from packed_transformers.components.step import NonFiniteStep
from packed_transformers.engines.engine import Engine
from packed_transformers.training.run_setup import RunSetup

log = logging.getLogger("training")


class Run(RunSetup, PretrainingJob):
    """One run on this process: built by RunSetup.__init__ (every user-input check first),
    driven by `train`, each piece a method."""

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
        self.resumed_train_seconds, self.paused_seconds = self.state.train_seconds, 0.0
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

    def train_seconds(self) -> float:
        """Seconds spent training: wall time since the start (plus the resumed run's) less
        evaluations and checkpoints. The clock of `max_train_seconds`, of each record's
        `train_seconds` and of the throughput figures: equal-time comparisons of packed
        and unpacked runs must not charge the run that evaluates more often."""
        return self.resumed_train_seconds + time.perf_counter() - self.started - self.paused_seconds

    @contextlib.contextmanager
    def _paused(self):
        """Time inside does not count as training time (evaluation, checkpoints)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.paused_seconds += time.perf_counter() - start

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
            counts = engine.train(micro_batches, self.lr, self.window)
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
        """Advance the bar: by steps, or to the fraction of the nearest limit (run_setup)."""
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
        self.evaluated_step = state.step
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

    # ----- checkpoints and the end -----------------------------------------------------
    def write_checkpoint(self) -> None:
        """Collective: a checkpoint of this step (rank 0 writes it), its time not training's."""
        self.state.train_seconds = self.train_seconds()
        with self._paused():
            try:
                path = ckpt_run.write_checkpoint(self.checkpoints, self.state, self.limits["keep_checkpoints"],
                                                 self.engine.snapshot(), self.engine.rank)  # fmt: skip
            except ckpt.CheckpointError as err:
                raise RunError(str(err)) from None
            if self.engine.rank == 0:
                log.info("checkpoint %s", path)
            self.saved_step = self.state.step

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
