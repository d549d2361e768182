"""MLPerf training log lines (mlperf-logging) in OUTPUT/mlperf.log, written on rank 0.

The lines MLCommons' compliance checker (`python -m mlperf_logging.compliance_checker
--usage training --ruleset 5.0.0`, closed BERT) requires, in the order it checks:

    cache_clear, init_start (timed at the model build), submission_*,
    global_batch_size, opt_* (after the packing adjustment), gradient_accumulation_steps,
    train_samples, eval_samples, seed, max_sequence_length       once each
    init_stop, run_start                          written once every check has passed
    block_start {samples_count}  ...  block_stop {samples_count}   around training between evaluations
    eval_start / eval_accuracy / eval_stop {epoch_num = training sequences so far}
    run_stop {status: success | aborted}

Packed steps: `global_batch_size` is an integer number of sequences. NVIDIA's packed
BERT submissions log packs per step x 2, the average packing rate MLPerf's BERT rules
use for packed data; so does this log (`mlperf_global_batch_size`), and step counts
derived from sample counts use that batch. Unpacked data (packing factor 1) logs packs
per step. The run's own sample counts (`epoch_num`, `samples_count`) are real sequences.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from packed_transformers.components.step import BatchArithmetic

PACKED_SEQUENCES_PER_PACK = 2  # NVIDIA's convention for packed BERT's global_batch_size


def mlperf_global_batch_size(batch: BatchArithmetic) -> int:
    """Sequences per step as MLPerf logs it: packs x 2 for packed data, packs unpacked."""
    per_pack = PACKED_SEQUENCES_PER_PACK if batch.packing_factor > 1.0 else 1
    return batch.packs_per_step * per_pack


def hyperparameters(config: dict, batch: BatchArithmetic) -> dict:
    """The closed-BERT keys with the values the run uses (after the packing adjustment).
    Step counts are the schedule's sample counts over the logged global batch size."""
    optim, gbs = config["optim"], mlperf_global_batch_size(batch)
    beta_1, beta_2 = batch.betas
    warmup_steps = math.ceil(optim["warmup_samples"] / gbs)
    return {
        "global_batch_size": gbs,
        "opt_base_learning_rate": optim["lr"],
        "opt_lamb_epsilon": optim["eps"],
        "opt_learning_rate_training_steps": math.ceil(optim["total_samples"] / gbs),
        "opt_learning_rate_warmup_steps": warmup_steps,
        "num_warmup_steps": warmup_steps,
        "start_warmup_step": math.floor(optim["start_offset_samples"] / gbs),
        "opt_lamb_beta_1": beta_1,
        "opt_lamb_beta_2": beta_2,
        "opt_lamb_weight_decay_rate": optim["weight_decay"],
        "gradient_accumulation_steps": batch.gradient_accumulation,
        "seed": config["training"]["seed"],
        "max_sequence_length": config["data"]["max_sequence_length"],
    }


class MlperfLog:
    """The run's MLPerf log; every method is a no-op where `path` is None (other ranks,
    logging.mlperf false). Blocks are closed before each evaluation and at the end."""

    def __init__(self, path: Path | None):
        self.logger = None
        self.in_block = False
        if path is None:
            return
        from mlperf_logging import mllog

        mllog_logger = mllog.get_mllogger().logger
        # mllog.config adds a file handler to its one shared logger per call and never removes
        # it: a second run in this process (a sweep, a test) would also write into the first
        # run's log. The log is per run: close the handlers of earlier runs first.
        for handler in list(mllog_logger.handlers):
            if isinstance(handler, logging.FileHandler):
                mllog_logger.removeHandler(handler)
                handler.close()
        mllog.config(filename=str(path))
        mllog_logger.propagate = False
        # mlperf-logging also echoes every line to stdout (a StreamHandler of its own): the
        # log belongs in OUTPUT/mlperf.log, not between the progress lines of the terminal.
        for handler in list(mllog_logger.handlers):
            if type(handler) is logging.StreamHandler:
                mllog_logger.removeHandler(handler)
        self.constants = mllog.constants
        self.logger = mllog.get_mllogger()

    def close(self) -> None:
        """Close the log file (the run is over); later calls are no-ops."""
        if self.logger is not None:
            for handler in list(self.logger.logger.handlers):
                if isinstance(handler, logging.FileHandler):
                    self.logger.logger.removeHandler(handler)
                    handler.close()
            self.logger = None

    def _event(self, key: str, value=None, metadata=None) -> None:
        if self.logger is not None:
            self.logger.event(key=key, value=value, metadata=metadata)

    def _start(self, key: str, metadata=None) -> None:
        if self.logger is not None:
            self.logger.start(key=key, value=None, metadata=metadata)

    def _end(self, key: str, metadata=None) -> None:
        if self.logger is not None:
            self.logger.end(key=key, value=None, metadata=metadata)

    # ----- the run's phases, in order ---------------------------------------------------
    def init(
        self,
        config: dict,
        platform: str,
        started_ms: float,
        batch: BatchArithmetic,
        train_samples: int,
        eval_samples: int,
    ) -> None:
        """The init phase: init_start (at `started_ms`, when the model build began), the
        submission fields, the hyperparameters as run, init_stop (now)."""
        self.init_benchmark(
            "bert",
            config["logging"],
            platform,
            started_ms,
            hyperparameters(config, batch),
            train_samples,
            eval_samples,
        )

    def init_benchmark(
        self, benchmark: str, logging_cfg: dict, platform: str, started_ms: float, settings: dict,
        train_samples: int, eval_samples: int,
    ) -> None:  # fmt: skip
        """The init phase of any benchmark: init_start at `started_ms`, the submission fields
        (logging_cfg: a config's logging section), `settings` (the hyperparameters as run,
        under MLPerf's keys), train and eval samples, init_stop (now)."""
        self._event("cache_clear", True)
        if self.logger is not None:
            self.logger.start(key="init_start", value=None, time_ms=started_ms)
        self._event("submission_benchmark", benchmark)
        self._event("submission_org", logging_cfg["submission_org"])
        self._event("submission_division", logging_cfg["submission_division"])
        self._event("submission_status", logging_cfg["submission_status"])
        self._event("submission_platform", logging_cfg["submission_platform"] or platform)
        for key, value in settings.items():
            self._event(key, value)
        self._event("train_samples", train_samples)
        self._event("eval_samples", eval_samples)
        self._end("init_stop")

    def run_start(self, samples: int) -> None:
        self._start("run_start")
        self.block_start(samples)

    def block_start(self, samples: int) -> None:
        self._start("block_start", {"samples_count": samples, "first_epoch_num": samples})
        self.in_block = True

    def block_stop(self, samples: int) -> None:
        if self.in_block:
            self._end("block_stop", {"samples_count": samples, "first_epoch_num": samples})
            self.in_block = False

    def evaluation(self, samples: int, accuracy: float, count_key: str = "epoch_num") -> None:
        """One evaluation at `samples` training sequences (closes the open block). count_key:
        the metadata key of the count (BERT's rules: epoch_num; llama31_8b's: samples_count)."""
        self.block_stop(samples)
        self._start("eval_start", {count_key: samples})
        self._event("eval_accuracy", accuracy, {count_key: samples})
        self._end("eval_stop", {count_key: samples})

    def run_stop(self, samples: int, status: str) -> None:
        self.block_stop(samples)
        self._end("run_stop", {"status": status})
