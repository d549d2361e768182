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

from packed_transformers.components.distributed import any_process
from packed_transformers.components.run_state import EXIT_DIVERGED, Diverged, interrupted_exit_code
from packed_transformers.components.step import weights_finite

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


class LoopJob:
    """What a training job gives the loop: the base of every run (BERT's `Run`, the decoder's
    `DecoderRun`, fine-tuning's `Run`). What every run answers alike is written here once, from
    what the run holds:

        state          components.run_state.RunState (its step is the loop's)
        eval_schedule  components.run_state.EvalSchedule
        stop           components.run_state.StopSignal (None: no signal handler)
        model          the weights a checkpoint keeps (checked finite first)
        saved_step     the step of the newest checkpoint (a resume's: not written again)
        steps_per_call optimizer steps one `train_call` makes (an IPU call makes several)

    A run writes what differs: limit_reached, train_call, evaluate, evaluates_at_end,
    write_checkpoint and close; with log lines, MLPerf blocks, a target or checkpoints every N
    steps also log_due, log_window, flush_window, after_evaluation, stops_at_target,
    checkpoint_every; an epoch schedule, epoch_in_progress."""

    steps_per_call = 1
    saved_step = None

    @property
    def step(self) -> int:
        return self.state.step

    def limit_reached(self) -> str | None:  # the limit's name, or None
        raise NotImplementedError

    def train_call(self) -> None:  # one engine call; raises Diverged
        raise NotImplementedError

    def log_due(self) -> bool:
        return False

    def log_window(self) -> None:  # raises Diverged (a window's non-finite loss)
        pass

    def flush_window(self) -> None:  # log the steps since the last line, if any
        pass

    def epoch_in_progress(self) -> tuple[int, int] | None:
        """(batches done, batches in it) of the epoch in progress, for an epoch schedule."""
        return None

    def evaluation_due(self) -> bool:
        """Whether to evaluate now; the schedule's next point moves past now."""
        return self.eval_schedule.claim(self.state, self.epoch_in_progress())

    def evaluate(self) -> bool:  # True: the target is reached
        raise NotImplementedError

    def after_evaluation(self) -> None:  # a block of training starts (MLPerf's block_start)
        pass

    def evaluates_at_end(self) -> bool:
        raise NotImplementedError

    def stops_at_target(self) -> bool:
        return False

    def checkpoint_every(self) -> int:
        """Checkpoint every this many steps (0: the run decides otherwise, checkpoint_due)."""
        return 0

    def checkpoint_due(self) -> bool:
        every = self.checkpoint_every()
        return bool(every) and self.state.step % every < self.steps_per_call

    def save(self) -> None:
        """Collective: never a checkpoint of non-finite weights (every run's rule: one
        reduction, one host sync; under FSDP2 each rank's shards, the verdict agreed), then the
        run's write_checkpoint."""
        if any_process(not weights_finite(self.model.parameters())):
            raise Diverged(f"step {self.state.step}: non-finite weights; refusing to checkpoint them")
        self.write_checkpoint()

    def write_checkpoint(self) -> None:  # collective
        raise NotImplementedError

    def stop_agreed(self) -> bool:
        """A signal, agreed by every process: any process's stops all at the same step."""
        return any_process(self.stop is not None and self.stop.is_set())

    def close(self, end: LoopEnd) -> None:  # always called; may raise, but not for "error"
        raise NotImplementedError


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
