"""The run's own state and its stop conditions: what a checkpoint carries of the run
(RunState), when evaluations fall (EvalSchedule), and the two ways a run stops early (a
signal, agreed by every replica; a non-finite step)."""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from packed_transformers.components.data import LoaderPosition

EXIT_DIVERGED = 3  # a non-finite loss, gradient norm or weight: no checkpoint written


@dataclass
class RunState:
    """Everything besides weights and optimizer that a checkpoint restores, one type for every
    run: the clock every run keeps, and in `extra` what its job adds (a dataclass of plain
    values per job: BertProgress, training.decoder.run.DecoderProgress,
    finetune.checkpoint.FinetuneProgress). Kept in training_state.pt as JSON (`to_json`)."""

    step: int = 0  # optimizer steps done
    samples: int = 0  # what the job trains on, all processes: sequences, rows (decoder), examples
    next_eval_samples: int = 0  # the evaluation schedule's next point (EvalSchedule)
    reached_target: bool = False
    train_seconds: float = 0.0  # training time so far, over resumes
    skipped_steps: int = 0  # non-finite steps skipped (training.on_nonfinite: skip), over resumes
    extra: Any = None  # the job's own progress

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    # a checkpoint's Stateful part (components.run_checkpoint): "state", as JSON
    def state_dict(self) -> dict:
        return {"state": self.to_json()}

    def load_state_dict(self, saved: dict) -> None:
        """A checkpoint's run state, read with this one's `extra` type (from_saved), in place of
        this one's. CheckpointError for one this version does not read (the caller names the file)."""
        vars(self).update(vars(RunState.from_saved(saved, type(self.extra), where="")))

    @classmethod
    def from_saved(cls, saved: dict, extra_type, where="the checkpoint's training_state.pt") -> RunState:
        """training_state.pt's run state (`saved["state"]`, JSON) with its job's `extra_type`.
        Checkpoints from before the one run state are read too: BERT's kept its fields flat
        beside the optimizer, the decoder's and fine-tuning's theirs in "state" without an
        "extra" (fine-tuning named `step` "steps" and `samples` "train_examples"). One that
        holds no such state (written by something else): CheckpointError naming `where`."""
        from packed_transformers.components.checkpoint import CheckpointError

        try:
            return cls._from_values(
                json.loads(saved["state"]) if "state" in saved else dict(saved), extra_type
            )
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise CheckpointError(
                f"{f'{where}: ' if where else ''}holds no run state this version reads ({type(err).__name__}: "
                f"{str(err)[:200]})"
            ) from None

    @classmethod
    def _from_values(cls, values: dict, extra_type) -> RunState:
        for old, new in (("steps", "step"), ("train_examples", "samples")):
            if old in values:
                values[new] = values.pop(old)
        common = {f.name for f in fields(cls)} - {"extra"}
        extra = values.get("extra")
        if extra is None:
            extra = {key: value for key, value in values.items() if key not in common}
        return cls(**{key: values[key] for key in common if key in values}, extra=extra_type.from_dict(extra))


def plain_values(cls, values: dict) -> dict:
    """The entries of `values` that are fields of the dataclass `cls` (a checkpoint may hold
    fewer, from before a field was kept, or more, from an engine)."""
    return {f.name: values[f.name] for f in fields(cls) if f.name in values}


@dataclass
class BertProgress:
    """BERT pretraining's part of the run state: the loader's position, the best evaluation and
    what a resume must keep (the run's config, its data's identity, its packs a step)."""

    position: LoaderPosition = field(default_factory=LoaderPosition)
    best_eval_accuracy: float = 0.0
    config: dict | None = None
    data_identity: str | None = None
    packs_per_step: int | None = None  # None: a checkpoint from before it was recorded

    @classmethod
    def from_dict(cls, values: dict) -> BertProgress:
        kept = plain_values(cls, values)
        kept["position"] = LoaderPosition(**kept.get("position", {}))
        return cls(**kept)


@dataclass(frozen=True)
class EvalSchedule:
    """When every run evaluates. By samples (pretraining; BERT's interval is eval.every_samples
    or MLPerf's rule, the decoder's eval.every_samples, 0 = never): each time the samples
    trained pass the next multiple of `every_samples`, the next point kept in the run state
    (`next_eval_samples`, resumed with it). By epoch (`per_epoch`, fine-tuning): when the epoch
    in progress has trained its last batch."""

    every_samples: int = 0
    per_epoch: bool = False

    def first(self) -> int:
        return self.every_samples

    def claim(self, state, epoch: tuple[int, int] | None = None) -> bool:
        """Whether an evaluation is due now; by samples the next point moves past now.
        `state`: samples and next_eval_samples (RunState); per epoch, `epoch` is the epoch in
        progress's (batches done, batches in it) (None: no epoch in progress)."""
        if self.per_epoch:
            return epoch is not None and epoch[0] == epoch[1]
        if not self.every_samples or state.samples < state.next_eval_samples:
            return False
        state.next_eval_samples = self.following(state)
        return True

    def following(self, state) -> int:
        """The first evaluation point after `state.samples`."""
        next_at = state.next_eval_samples
        while next_at <= state.samples:
            next_at += self.every_samples
        return next_at


class Diverged(RuntimeError):
    """The run stops on a non-finite step or weights (training.on_nonfinite); the message
    names the step. No checkpoint is written for it."""


def skip_or_stop(where: str, err: Exception, skipped: int, policy: str = "stop", allowed: int = 0) -> None:
    """Every run's answer to a step the engine refused (components.step.NonFiniteStep: a
    non-finite loss or gradient norm, the weights untouched): return (skip it: a warning)
    while `policy` is "skip" and the run's `skipped` steps, this one counted, are at most
    `allowed`; else Diverged with one line. Pretraining's budget is training.on_nonfinite and
    max_skipped_steps; decoder pretraining and fine-tuning stop at the first."""
    if policy == "skip" and skipped <= allowed:
        logging.getLogger("training").warning("%s: non-finite %s: step skipped (%d of at most %d)", where, err,
                                              skipped, allowed)  # fmt: skip
        return
    reason = f"more than {allowed} skipped steps" if policy == "skip" else "a non-finite step stops the run"
    raise Diverged(
        f"diverged: {where}: non-finite {err}; stopping ({reason}; a lower learning rate?); "
        "no checkpoint written for it, the newest is the last good one"
    )


class StopSignal:
    """SIGTERM / SIGINT -> finish the current step, checkpoint, exit 128 + the signal's number
    (143 for SIGTERM, 130 for SIGINT: `interrupted_exit_code`): every training command's. The
    handlers act in this process only (a library's child process forked later ends by the
    signal's default action: common.cli.own_process_handler), are installed from the main
    thread only (a run started from another thread is stopped through `is_set`'s callers) and
    `restore` puts back what was there."""

    received: list[int] = []  # the signals this process received, in order

    def __init__(self):
        import threading

        from packed_transformers.common.cli import own_process_handler

        self.requested = False
        StopSignal.received = []
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, own_process_handler(self._handle))
                             for sig in (signal.SIGTERM, signal.SIGINT)}  # fmt: skip

    def _handle(self, signum, frame):
        if not self.requested:
            said_at_once(signum)
        self.requested = True
        StopSignal.received.append(signum)

    def is_set(self) -> bool:
        """Whether this process was asked to stop."""
        return self.requested

    @property
    def signum(self) -> int:
        """The first signal received (SIGTERM's number where another process was signalled)."""
        return StopSignal.received[0] if StopSignal.received else signal.SIGTERM

    def restore(self) -> None:
        """The handlers from before (a command called from a program hands them back)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def said_at_once(signum: int) -> None:
    """One stderr line as the first stop signal arrives (rank 0's, under torchrun): a step may
    take long under load (30 s of silence after Ctrl-C in contrastive training looked ignored),
    so the run says at once what it will do, and the usual line follows when it has."""
    import os
    import sys

    if os.environ.get("RANK", "0") != "0":
        return
    try:
        print(f"\n{signal.Signals(signum).name}: stopping after this step, then keeping a checkpoint",
              file=sys.stderr, flush=True)  # fmt: skip
    except (OSError, ValueError):  # stderr closed or gone: the stop itself still happens
        pass


def interrupted_exit_code() -> int:
    """A run stopped by a signal exits 128 + the first signal this process received (130 for
    Ctrl-C); a replica stopped because another one was signalled exits 143 (SIGTERM's)."""
    return 128 + (StopSignal.received[0] if StopSignal.received else signal.SIGTERM)


def exit_code_of(body: Callable[[], int]) -> int:
    """How a pretraining run ends as a process exit code, written once for the BERT run and the
    decoder run (run_pretraining.py's contract): body()'s exit code; RunError, CheckpointError (a checkpoint not written: its older ones
    are intact) and PackingInputError (a shard that changed or breaks the format, found at read
    time) -> their line, exit 2; OSError (a full disk, a read-only or misplaced folder) ->
    its line with the path, exit 2. The process group is shut down whatever happens."""
    from packed_transformers.common.cli import refuse
    from packed_transformers.common.files import describe_os_error
    from packed_transformers.components.checkpoint import CheckpointError
    from packed_transformers.components.data import one_line
    from packed_transformers.components.distributed import shut_down_process_group
    from packed_transformers.components.errors import RunError
    from packed_transformers.packs.errors import PackingInputError

    try:
        return body()
    except (RunError, CheckpointError, PackingInputError) as err:
        return refuse(one_line(err))
    except OSError as err:
        return refuse(describe_os_error(err))
    finally:
        shut_down_process_group()
