"""Every run's one Trainer (BERT's pretraining on every engine, the decoder's, fine-tuning's):
the setup written once, in one order. A job is a subclass that says what each phase is for it
(torchtitan's Trainer over a TrainSpec; training/specs.py registers the pretraining jobs,
finetune/specs.py the fine-tuning tasks):

    open_data       the data (a task's input) opened and checked against the config, nothing built
    build           the replica and the engine, the model (checked against the data), placed
                    (the decoder and fine-tuning: sharded or replicated, their optimizer built)
    prepare_folder  locked and checked (another run there; a --resume of other settings)
    read_checkpoint the newest intact checkpoint's weights (`load_checkpoint`), its run state
                    and this rank's RNG (components.run_checkpoint)
    attach          the engine's optimizer and step; a checkpoint's optimizer state restored
    state           fresh (`new_progress`), or the checkpoint's once the job's `check_resume`
                    passed; what it keeps for a later resume (`record_progress`)
    open_position   the data read on from the state's position, the evaluation set
    open_records    config.yaml, metrics.jsonl's later lines forgotten on --resume, the
                    reporter, MLPerf's init lines (`start_reporting`), the stop signal

--compile-only (BERT on IPUs) builds and checks everything and writes nothing to the folder.
Then the loop (components.loop.run_loop) drives it. `PretrainingTrainer` answers it for the two
pretraining runs alike: the training.* limits with every process's clock agreed (one that
stopped alone would leave the others waiting in a collective), MLPerf's blocks, the eval
target, checkpoints every N steps and their time kept out of training's, the end record.
Never imports engines/, training/ or finetune/.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import NamedTuple

from packed_transformers.components import run_checkpoint as ckpt_run
from packed_transformers.components.distributed import any_process
from packed_transformers.components.loop import RESUMED_COMPLETE, LoopEnd, LoopJob, run_loop
from packed_transformers.components.observe import Reporter
from packed_transformers.components.run_folder import CHANGEABLE_ON_RESUME, prepare_output, write_run_config
from packed_transformers.components.run_state import EvalSchedule, RunState, StopSignal

log = logging.getLogger("training")


class Resumed(NamedTuple):
    """The checkpoint a --resume took up: its folder, its run state (of the job's progress type)
    and its training state as loaded (None where the job kept nothing of it for later)."""

    path: Path
    state: RunState
    saved: dict | None


class Trainer(LoopJob):
    """One run on this process, set up by `__init__` in the module's order. A job sets
    `progress_type` (its RunState.extra) and `changeable` (the config keys a --resume may
    change: what only splits the global batch) and writes the phases below; `rank` is set by
    its `open_data` or `build`."""

    progress_type: type
    changeable: frozenset = CHANGEABLE_ON_RESUME
    rank: int  # this process's, set by the job's open_data or build

    def __init__(self, config: dict, output: Path, resume: bool):
        self.config, self.output, self.limits, self.resume = config, output, config["training"], resume
        self.compile_only = bool(config["execution"].get("compile_only"))
        self.open_data()
        # MLPerf's init phase starts at the model build; its lines are written once every check
        # has passed (no log file for a run that is refused)
        self.init_started_ms = time.time() * 1000
        self.build()
        if not self.compile_only:  # a later real run in the folder must not find "another run"
            self.prepare_folder(resume)
        resumed = self.read_checkpoint() if resume else None
        self.attach(resumed)
        self.eval_schedule = self.make_eval_schedule()
        self.state = RunState(next_eval_samples=self.eval_schedule.first(), extra=self.new_progress())
        if resumed is not None:
            self.check_resume(resumed.path, resumed.state)
            self.state = resumed.state
            if self.state.next_eval_samples == 0:  # a checkpoint from before it was kept
                self.state.next_eval_samples = self.eval_schedule.first()
            if self.rank == 0:
                log.info(self.resumed_line(resumed.path))
        self.record_progress(self.state.extra)
        self.open_position()
        self.saved_step = self.state.step if resumed is not None else None  # not written again
        if not self.compile_only:
            self.open_records(resumed is not None)

    # ----- the job's phases (the module's docstring) -------------------------------------
    def open_data(self) -> None:
        raise NotImplementedError

    def build(self) -> None:
        raise NotImplementedError

    def prepare_folder(self, resume: bool) -> None:
        """The folder locked, refused where it holds another run (or, on --resume, a run of other
        settings than `changeable` allows); config.yaml is written once every check passed."""
        prepare_output(self.output, self.config, resume, self.rank, changeable=self.changeable)

    def load_checkpoint(self, path: Path, saved: dict) -> None:
        """A checkpoint's weights (and where the job restores it here, its optimizer's state)
        into the run: ckpt.resume_from's loader, which falls back to an older checkpoint when
        this one's files do not load."""
        raise NotImplementedError

    def attach(self, resumed: Resumed | None) -> None:
        """The engine's optimizer and step; resumed: the checkpoint whose weights were loaded,
        or None."""

    def make_eval_schedule(self) -> EvalSchedule:
        raise NotImplementedError

    def new_progress(self):
        """A new run's progress record (RunState.extra)."""
        return self.progress_type()

    def check_resume(self, path: Path, restored: RunState) -> None:
        """Refuse (RunError, "--resume: ...") a checkpoint whose record (restored.extra, of
        progress_type) says it is another run's: its settings, data or global batch."""

    def resumed_line(self, path: Path) -> str:
        """What rank 0 logs of the checkpoint a --resume continues from, once its checks passed."""
        return f"resumed from {path} (step {self.state.step}, {self.state.samples} samples)"

    def record_progress(self, progress) -> None:
        """What every checkpoint keeps for a resume to check (this run's settings and batch)."""

    def open_position(self) -> None:
        """The data read on from the state's position; the evaluation set."""

    def open_records(self, resumed: bool) -> None:
        """config.yaml; metrics.jsonl's lines after the checkpoint forgotten (a resume trains and
        logs those steps again); the reporter, MLPerf's init lines, the stop signal."""
        write_run_config(self.output, self.config, self.rank)
        if resumed:
            ckpt_run.forget_lines_after(self.output, self.state.step, self.rank)
        self.reporter = Reporter(self.output, self.config, self.rank)
        self.stop = StopSignal()
        self.start_reporting()

    def start_reporting(self) -> None:
        """MLPerf's init lines; a progress bar."""

    # ----- resume and checkpoints --------------------------------------------------------
    def read_checkpoint(self) -> Resumed:
        """--resume: what a crash left half-written removed, then the newest intact checkpoint's
        weights loaded (load_checkpoint), its run state read, this rank's RNG put back."""
        state = RunState(extra=self.new_progress())  # the checkpoint's, once restored into it
        path, saved = ckpt_run.resume_pretraining(self.output, self.load_checkpoint, self.parts(state), self.rank,
                                                  clean=not self.compile_only)  # fmt: skip
        return Resumed(path, state, saved)

    def parts(self, state: RunState) -> tuple:
        """What a checkpoint keeps of this run besides the engine's (components.run_checkpoint's
        Stateful parts): the run state (with the job's progress and data position), the RNG."""
        return state, ckpt_run.RngStates(self.rank)


class PretrainingTrainer(Trainer):
    """What the pretraining runs (BERT's, the decoder's) answer the loop alike, from what they
    hold (`config`, `reporter`: components.observe.Reporter, `state`): the training.* limits,
    every process's clock agreed, MLPerf's blocks, the eval target, checkpoints every N steps
    and their time kept out of training's, the end record. A run adds `begin` (its start: lines,
    the first logging window) and `end_figures` (its own entries of the end record)."""

    def snapshot(self):
        """The engine's Snapshot of this step (engines.engine.Snapshot; collective)."""
        raise NotImplementedError

    def write_checkpoint(self) -> None:
        """Collective: a checkpoint of this step (rank 0 writes it; every rank its shards where
        sharded), its time not training's."""
        self.state.train_seconds = self.train_seconds()
        with self._paused():
            path = ckpt_run.write_checkpoint(self.output / "checkpoints", self.parts(self.state),
                                             self.limits["keep_checkpoints"], self.snapshot(), self.rank)  # fmt: skip
        if self.rank == 0:
            log.info("checkpoint %s", path)

    def train_seconds(self) -> float:
        """Seconds spent training: wall time since the start (plus the resumed run's) less
        evaluations and checkpoints. The clock of `max_train_seconds`, of each record's
        `train_seconds` and of the throughput figures: equal-time comparisons of packed and
        unpacked runs must not charge the run that evaluates more often."""
        return self.resumed_train_seconds + time.perf_counter() - self.started - self.paused_seconds

    @contextlib.contextmanager
    def _paused(self):
        """Time inside does not count as training time (evaluations, checkpoints)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.paused_seconds += time.perf_counter() - start

    # ----- what the loop asks ------------------------------------------------------------
    def train(self) -> int:
        """Train until a limit, the target or a signal; -> the process exit code."""
        # the clock goes on from the checkpoint's training time
        self.resumed_train_seconds, self.paused_seconds = self.state.train_seconds, 0.0
        self.started = time.perf_counter()
        self.begin()
        self.reporter.mlperf.run_start(self.state.samples)
        end = run_loop(self)
        if end.diverged:
            print(f"error: {end.diverged}", file=sys.stderr)
        return end.exit_code

    def begin(self) -> None:
        pass

    def limit_reached(self) -> str | None:
        """The training.* limit reached ("max_steps", "max_samples", "max_train_seconds",
        "max_seconds"), or None; a clock's verdict is every process's."""
        state, limits = self.state, self.config["training"]
        if state.step >= limits["max_steps"]:
            return "max_steps"
        if limits.get("max_samples") is not None and state.samples >= limits["max_samples"]:
            return "max_samples"
        clocks = {"max_train_seconds": lambda: self.train_seconds(),
                  "max_seconds": lambda: time.perf_counter() - self.started}  # fmt: skip
        for name, seconds in clocks.items():
            if limits.get(name) is not None and any_process(seconds() >= limits[name]):
                return name
        return None

    def after_evaluation(self) -> None:  # a block of training starts
        self.reporter.mlperf.block_start(self.state.samples)

    def stops_at_target(self) -> bool:
        return bool(self.config["eval"]["stop_at_target"])

    def checkpoint_every(self) -> int:
        return self.config["training"]["checkpoint_every_steps"]

    def end_figures(self) -> dict:
        """The run's own entries of its end record (after step and samples)."""
        return {}

    def close(self, end: LoopEnd) -> None:
        """The process's MLPerf block closed, the end record written (a resumed complete run
        wrote its own when it finished), the reporter closed."""
        state = self.state
        self.reporter.mlperf.run_stop(state.samples, end.status)
        if end.stopped_by == RESUMED_COMPLETE:
            log.info("the run was complete at step %d: nothing trained, nothing recorded", state.step)
        else:
            self.reporter.log({"step": state.step, "samples": state.samples, **self.end_figures(),
                               "status": end.status, "stopped_by": end.stopped_by,
                               "seconds": time.perf_counter() - self.started}, "end")  # fmt: skip
        self.reporter.close()
