"""The one training loop of every run: BERT pretraining (training.run.Run), decoder
pretraining (training.decoder.run.DecoderRun) and fine-tuning (finetune.train's run). When to
log, evaluate, checkpoint and stop is decided here, once; what a step, an evaluation and a
checkpoint are is the job's (`LoopJob`).

    while the job names no limit reached:
        one step (an engine call)  ->  log when due  ->  evaluate when due (stop at the target)
        ->  checkpoint when due  ->  stop on a signal (every process agrees)
    end:  the last window logged, an evaluation at the end (never twice for the same
          weights), a checkpoint (never twice for the same step), the job closed

How a run ends (`LoopEnd`): exit 0 (a limit or the target), 128 + the signal (130 Ctrl-C, 143 SIGTERM: the
checkpoint of the step it stopped at is written), EXIT_DIVERGED (the job raised Diverged: a
non-finite step or weights; nothing is written for it, the newest checkpoint is the last
good one). `status` is MLPerf's run_stop status: success only at the target.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from packed_transformers.components.run_state import EXIT_DIVERGED, Diverged, interrupted_exit_code

log = logging.getLogger("training")
EXIT_ERROR = 1  # an exception ended the loop; it propagates (the command maps it to its exit code)


@dataclass(frozen=True)
class LoopEnd:
    """How the loop ended: the process exit code, MLPerf's status ("success" | "aborted"),
    what stopped it ("target", a limit's name, "signal", "diverged", or "error": an exception
    that propagates past close) and, diverged, the one line saying where (the job prints or
    raises it)."""

    exit_code: int
    status: str
    stopped_by: str
    diverged: str | None = None


# LoopEnd.stopped_by of a run resumed after it had finished: close() adds no end record
RESUMED_COMPLETE = "already complete"


class LoopJob(Protocol):
    """What a training job gives the loop. `step` counts optimizer steps done (run state);
    `steps_per_call` how many one `train_call` makes (an IPU call makes several)."""

    step: int
    steps_per_call: int
    saved_step: int | None  # the step of the newest checkpoint (a resume's: not written again)

    def limit_reached(self) -> str | None: ...  # the limit's name, or None
    def train_call(self) -> None: ...  # one engine call; raises Diverged
    def log_due(self) -> bool: ...
    def log_window(self) -> None: ...  # raises Diverged (a window's non-finite loss)
    def flush_window(self) -> None: ...  # log the steps since the last line, if any
    def evaluation_due(self) -> bool: ...  # and moves the next evaluation point past now
    def evaluate(self) -> bool: ...  # True: the target is reached
    def after_evaluation(self) -> None: ...  # a block of training starts (MLPerf's block_start)
    def evaluates_at_end(self) -> bool: ...
    def stops_at_target(self) -> bool: ...
    def checkpoint_due(self) -> bool: ...
    def save(self) -> None: ...  # collective; raises Diverged for non-finite weights
    def stop_agreed(self) -> bool: ...  # a signal, agreed by every process
    def close(self, end: LoopEnd) -> None: ...  # always called; may raise, but not for "error"


def run_loop(job: LoopJob) -> LoopEnd:
    """Train `job` until a limit, its target or a signal (the module's docstring)."""
    status, exit_code = "aborted", 0
    reached, evaluated_step = False, None

    def evaluate() -> bool:
        nonlocal evaluated_step
        evaluated_step = job.step
        return job.evaluate() and job.stops_at_target()

    # what close() is told if an exception other than Diverged ends the loop (it propagates)
    end = LoopEnd(EXIT_ERROR, status, "error")
    # a finished run resumed: at its limit, with the checkpoint of that step; it evaluated and
    # wrote its records when it finished, so nothing is trained, evaluated or recorded again
    complete_at_start = job.limit_reached() is not None and job.saved_step == job.step
    if complete_at_start:
        evaluated_step = job.step
    try:
        while not job.limit_reached():
            job.train_call()
            if job.log_due():
                job.log_window()
            if job.evaluation_due():
                if evaluate():
                    reached, status = True, "success"
                    break
                job.after_evaluation()
            if job.checkpoint_due():
                job.save()
                job.saved_step = job.step
            # a signal at the last step ends the run as complete (every process sees the limit)
            if not job.limit_reached() and job.stop_agreed():
                log.warning("stop requested (signal): checkpointing at step %d", job.step)
                exit_code = interrupted_exit_code()
                break
        if exit_code == 0:
            job.flush_window()  # the steps since the last line (a short or time-budget run)
        if exit_code == 0 and not reached and job.evaluates_at_end() and evaluated_step != job.step:
            if evaluate():
                reached, status = True, "success"
        if job.saved_step != job.step:
            job.save()
            job.saved_step = job.step
        stopped_by = (
            RESUMED_COMPLETE if complete_at_start
            else "target" if reached else "signal" if exit_code else job.limit_reached() or "limit"
        )  # fmt: skip
        end = LoopEnd(exit_code, status, stopped_by)
    except Diverged as err:
        end = LoopEnd(EXIT_DIVERGED, status, "diverged", str(err))
    finally:
        job.close(end)
    return end


class LoopJobDefaults:
    """What a job without per-step log lines, MLPerf blocks or a target says (fine-tuning):
    a base to inherit, so a job writes only the answers it has."""

    def log_due(self) -> bool:
        return False

    def log_window(self) -> None:
        pass

    def flush_window(self) -> None:
        pass

    def after_evaluation(self) -> None:
        pass

    def stops_at_target(self) -> bool:
        return False
