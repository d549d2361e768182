"""The run: the same for every engine (training.backends: torch, pipeline, ipu).

    checks (data, output folder, model)  ->  engine.attach  ->  restore a checkpoint
    loop:  micro-batches from the resumable loader  ->  engine.train (one place for the
           step's math: training.step)  ->  log window  ->  evaluation when due  ->
           checkpoint when due  ->  stop on max_steps / max_samples / max_seconds / signal
    end:   evaluation at the end, final checkpoint, MLPerf RUN_STOP

A batch goes: packed shard rows (training.data) -> dict of [B, S] / [B, M] / [B, K] int
tensors -> engine -> PackedBertForPreTraining -> sums and counts -> loss normalised by
the step's GLOBAL masked-token and sequence counts -> backward -> LAMB step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from common.files import FolderInUse, atomic_path, describe_os_error, lock_folder, sha256_file
from model import PackedBertForPreTraining, validate_batch
from packing.errors import PackingInputError
from training import checkpoint as ckpt
from training.backends.engine import Engine
from training.build import (
    build_model,
    build_schedule,
    check_model_fits_data,
    mlperf_eval_interval,
    open_packed,
    packing_factor,
)
from training.curves import MetricsFileError, read_metric_lines
from training.data import (
    LoaderPosition,
    PackedShards,
    ReplicaSampler,
    advance,
    eval_batches,
    make_loader,
    one_line,
    padded_groups,
)
from training.distributed import any_process, barrier, gather_rng_states, shut_down_process_group
from training.errors import RunError
from training.observe import MetricSums, Reporter, summarize
from training.step import NonFiniteStep
from training.synthetic import SyntheticPacks

log = logging.getLogger("training")
EXIT_INTERRUPTED = 143
EXIT_DIVERGED = 3  # a non-finite loss, gradient norm or weight: no checkpoint written


@dataclass
class RunState:
    """Everything besides weights and optimizer that a checkpoint restores."""

    step: int = 0
    samples: int = 0  # real sequences trained on, all replicas
    position: LoaderPosition = field(default_factory=LoaderPosition)
    next_eval_samples: int = 0
    best_eval_accuracy: float = 0.0
    reached_target: bool = False
    train_seconds: float = 0.0  # training time so far, all processes of the run (see Run.train_seconds)
    skipped_steps: int = 0  # non-finite steps skipped (training.on_nonfinite: skip), over resumes

    def to_checkpoint(self) -> dict:
        return {
            "skipped_steps": self.skipped_steps,
            "step": self.step,
            "samples": self.samples,
            "position": self.position.as_dict(),
            "next_eval_samples": self.next_eval_samples,
            "best_eval_accuracy": self.best_eval_accuracy,
            "train_seconds": self.train_seconds,
        }

    @classmethod
    def from_checkpoint(cls, saved: dict) -> RunState:
        return cls(
            step=saved["step"],
            samples=saved["samples"],
            position=LoaderPosition(**saved["position"]),
            next_eval_samples=saved["next_eval_samples"],
            best_eval_accuracy=saved["best_eval_accuracy"],
            train_seconds=saved.get("train_seconds", 0.0),  # absent in checkpoints before it was kept
            skipped_steps=saved.get("skipped_steps", 0),
        )


@dataclass(frozen=True)
class EvalSchedule:
    """Evaluate each time the samples trained pass the next multiple of `every_samples`
    (an interval of eval.every_samples or MLPerf's rule); the next point is run state."""

    every_samples: int

    def first(self) -> int:
        return self.every_samples

    def due(self, state: RunState) -> bool:
        return state.samples >= state.next_eval_samples

    def following(self, state: RunState) -> int:
        """The first evaluation point after `state.samples`."""
        next_at = state.next_eval_samples
        while next_at <= state.samples:
            next_at += self.every_samples
        return next_at


class Diverged(RuntimeError):
    """The run stops on a non-finite step or weights (training.on_nonfinite); the message
    names the step. No checkpoint is written for it."""


class StopSignal:
    """SIGTERM / SIGINT -> finish the current step, checkpoint, exit 143."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self) -> bool:
        """Any replica's signal stops all of them at the same step."""
        return any_process(self.requested)


# Keys of the fixed sections that change how the run is done, not what it computes.
CHANGEABLE_ON_RESUME = {("data", "loader_workers"), ("data", "validate_batches"), ("data", "check_sha256")}


def check_same_run(previous: dict, config: dict, what: str) -> None:
    """RunError unless `config` keeps the model, data and optim settings of `previous`
    (config.yaml, or the config a checkpoint holds)."""
    for section in ("model", "data", "optim"):
        before, now = (previous or {}).get(section) or {}, config[section]
        changed = [k for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
        changed = [k for k in changed if (section, k) not in CHANGEABLE_ON_RESUME]
        if changed:
            key = changed[0]
            raise RunError(
                f"--resume: {section}.{key} is {now.get(key)!r}, {what} has "
                f"{before.get(key)!r}; model, data and optim settings cannot change on resume "
                "(training/eval/logging/execution settings and data.loader_workers, "
                "data.validate_batches, data.check_sha256 can)"
            )


def data_identity(config: dict) -> str | None:
    """sha256 of the training data's metadata.json (its plan, packing factor, K, counts and
    every shard's sha256): the same path holding re-packed data is other data. None for
    synthetic data."""
    if config["data"]["synthetic"]:
        return None
    return sha256_file(Path(config["data"]["train_dir"]) / "metadata.json")


def prepare_output(output: Path, config: dict, resume: bool, rank: int) -> None:
    """Lock the folder and refuse one that holds another run (or, on resume, a run of other
    model / data / optim settings). config.yaml is written later (write_run_config)."""
    saved = output / "config.yaml"
    if rank == 0:  # one run per folder: a second --resume on it must not train beside this one
        try:
            lock_folder(output, "run")
        except FolderInUse as err:
            raise RunError(f"--output-dir: {err}") from None
    if saved.is_file():
        if not resume:
            raise RunError(
                f"--output-dir {output} holds another run (config.yaml); pass --resume to continue it "
                "or choose another directory"
            )
        check_same_run(yaml.safe_load(saved.read_text()), config, f"the run in {output}")
    elif output.is_dir() and any(output.iterdir()) and not resume:
        raise RunError(f"--output-dir {output} is not empty and holds no run")
    # Every rank checks before rank 0 writes: otherwise a slower rank finds the config.yaml
    # rank 0 just wrote and refuses the folder as "another run".
    barrier()


def write_run_config(output: Path, config: dict, rank: int) -> None:
    """OUTPUT/config.yaml, written once every check of the run has passed: a refused
    command leaves nothing that would refuse its corrected rerun."""
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        with atomic_path(output / "config.yaml") as tmp:
            tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    barrier()


class Run:
    """One run on this process: built by __init__ (every user-input check first), driven
    by `train`, each piece a method."""

    def __init__(self, config: dict, output: Path, resume: bool, engine_class: type[Engine]):
        """The run's phases, in order: data opened and checked, the engine, the output
        folder, the model, a checkpoint restored, the loader, the evaluation set, logging.
        Every user-input check happens before config.yaml is written (the last phase)."""
        self.config, self.output, self.limits = config, output, config["training"]
        # --compile-only builds and checks everything but writes nothing to the run folder
        # (a later real run there must not find "another run").
        self.compile_only = config["execution"]["compile_only"]
        train_data, eval_data = self._open_data()
        self.engine = engine_class(config)
        if not self.compile_only:
            prepare_output(output, config, resume, self.engine.rank)
        # MLPerf's init phase starts at the model build; its lines are written once every
        # check has passed (no log file for a run that is refused).
        init_started_ms = time.time() * 1000
        self.model = build_model(config, self.limits["seed"])
        if train_data is None:
            train_data = self._synthetic_packs()
        check_model_fits_data(self.model, train_data)
        if eval_data is not None:  # checked like the training data: not hours in, at the first evaluation
            check_model_fits_data(self.model, eval_data, "data.eval_dir")
        saved = self._restore_checkpoint(resume)
        # What the step is made of, after the packing adjustment (training.step.BatchArithmetic).
        self.arithmetic = self.engine.attach(self.model, packing_factor(train_data))
        self.schedule = build_schedule(config)
        self.state = RunState()
        if saved is not None:
            self._restore_state(saved)
        self.shards = (
            train_data
            if config["data"]["synthetic"]
            else PackedShards(train_data, self.model.config.vocab_size, self.model.config.type_vocab_size)
        )
        self.loader = self._make_loader()
        every = config["eval"]["every_samples"] or mlperf_eval_interval(self.arithmetic.sequences_per_step)
        self.eval_schedule = EvalSchedule(int(every))
        if self.state.next_eval_samples == 0:
            self.state.next_eval_samples = self.eval_schedule.first()
        eval_set = self._eval_set(eval_data)
        self.eval_set = eval_set[:2] if eval_set else None  # (shards, this replica's batches)
        if self.compile_only:
            return
        write_run_config(output, config, self.engine.rank)
        self._start_logging(init_started_ms, train_data.sequences, eval_set[2] if eval_set else 0)
        self.saved_step = self.state.step if saved is not None else None

    # ----- the phases of __init__ ------------------------------------------------------
    def _open_data(self):
        """(train data or None when synthetic, eval data or None), each checked against the
        config (S, K, shard names, sizes, counts, sha256)."""
        data = self.config["data"]
        train = None if data["synthetic"] else open_packed(data["train_dir"], self.config, "train")
        evaluation = open_packed(data["eval_dir"], self.config, "eval") if data["eval_dir"] else None
        return train, evaluation

    def _synthetic_packs(self) -> SyntheticPacks:
        """data.synthetic: random well-formed packs, made for this model's vocabulary."""
        data = self.config["data"]
        if self.engine.rank == 0:
            log.warning("data.synthetic: random packs, no data read; throughput check only")
        return SyntheticPacks(
            data["max_sequence_length"],
            data["max_sequences_per_pack"],
            data["synthetic_packing_factor"],
            self.model.config.vocab_size,
            data["shuffle_seed"],
        )

    def _restore_checkpoint(self, resume: bool) -> dict | None:
        """With --resume: the newest intact checkpoint's weights into the model and its
        training state returned (None without --resume). Half-written checkpoints a crash
        left are removed first."""
        self.checkpoints = self.output / "checkpoints"
        if self.engine.rank == 0 and not self.compile_only:
            for leftover in ckpt.remove_leftovers(self.checkpoints):
                log.warning("removed %s, a checkpoint a crash left half-written", leftover)
        if not resume:
            return None
        restored = ckpt.latest_valid_checkpoint(self.checkpoints)
        if restored is None:
            raise RunError(
                f"--resume: {self.checkpoints} holds no intact checkpoint to resume from; to start "
                f"over, run without --resume in a new --output-dir (or delete {self.output})"
            )
        try:
            saved = ckpt.load_training_state(restored)
        except ckpt.CheckpointError as err:
            raise RunError(f"--resume: {err}") from None
        weights = PackedBertForPreTraining.from_pretrained(restored / "model").state_dict()
        self.model.load_state_dict(weights)
        return saved

    def _restore_state(self, saved: dict) -> None:
        """The engine's state (optimizer), the run state and this replica's RNG state."""
        engine = self.engine
        # The checkpoint's own record, not only config.yaml (which a user can delete or
        # edit): the same settings, and the same data at the data path.
        if "config" in saved:
            check_same_run(saved["config"], self.config, "the checkpoint")
        before, now = saved.get("data_identity"), data_identity(self.config)
        if before is not None and before != now:
            raise RunError(
                f"--resume: {self.config['data']['train_dir']}/metadata.json has sha256 {str(now)[:12]}..., "
                f"the checkpoint was trained on {before[:12]}...: the data at data.train_dir changed "
                "(re-packed or replaced) since; resume on the data it was trained on, or start a new run"
            )
        engine.load_state(saved)
        self.state = RunState.from_checkpoint(saved)
        # Lines logged after the checkpoint are trained again.
        if engine.rank == 0 and not self.compile_only:
            try:
                forget_metrics_after(self.output / "metrics.jsonl", self.state.step)
            except MetricsFileError as err:
                raise RunError(f"--resume: {err}") from None
        rng = saved["rng"]
        ckpt.set_rng_state(rng[engine.rank] if engine.rank < len(rng) else rng[0])

    def _make_loader(self):
        """This replica's resumable iterator of micro-batches, from the restored position."""
        data = self.config["data"]
        try:
            self.sampler = ReplicaSampler(
                len(self.shards),
                self.arithmetic.micro_batch_packs,
                data["shuffle_seed"],
                self.engine.data_rank,
                self.engine.data_world,
                self.state.position,
            )
        except ValueError as err:
            raise RunError(f"data.micro_batch_packs {self.arithmetic.micro_batch_packs}: {err}") from None
        return iter(make_loader(self.shards, self.sampler, data["loader_workers"]))

    def _eval_set(self, eval_data):
        """(shards, this replica's batches, sequences) of the evaluation set, or None."""
        if not eval_data:
            return None
        return eval_batches(
            eval_data,
            self.arithmetic.micro_batch_packs,
            self.config["eval"]["max_sequences"],
            self.engine.data_rank,
            self.engine.data_world,
            self.model.config.vocab_size,
        )

    def _start_logging(self, init_started_ms: float, train_samples: int, eval_samples: int) -> None:
        """metrics.jsonl / TensorBoard / MLPerf init lines, the signal handler, the progress bar."""
        config, engine = self.config, self.engine
        self.reporter = Reporter(self.output, config, engine.rank)
        self.reporter.mlperf.init(
            config,
            platform_name(config, engine),
            init_started_ms,
            self.arithmetic,
            train_samples=train_samples,
            eval_samples=eval_samples,
        )
        self.stop = StopSignal()
        self.evaluated_step = None
        self.progress = tqdm(
            total=self.limits["max_steps"],
            initial=self.state.step,
            unit="step",
            dynamic_ncols=True,
            disable=engine.rank != 0 or not config["logging"]["progress"],
        )

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

    # ----- the loop --------------------------------------------------------------------
    def train(self) -> int:
        """Train until a limit, the target or a signal. Returns the process exit code."""
        state, config, engine = self.state, self.config, self.engine
        if engine.rank == 0:
            log.info(self.arithmetic.adjusted.describe())
            log.info(
                "%s; eval every %d sequences", self.arithmetic.describe(), self.eval_schedule.every_samples
            )
        self.reporter.mlperf.run_start(state.samples)
        status, exit_code, self.started = "aborted", 0, time.perf_counter()
        self.resumed_train_seconds, self.paused_seconds = state.train_seconds, 0.0
        self._new_window()
        try:
            try:
                while not self._limit_reached():
                    lr = self._train_call()
                    if state.step % self.limits["log_every_steps"] < engine.steps_per_call or (
                        state.step >= self.limits["max_steps"]
                    ):
                        self._log_window(lr)
                    if self.eval_schedule.due(state):
                        state.next_eval_samples = self.eval_schedule.following(state)
                        if self._evaluate() and config["eval"]["stop_at_target"]:
                            state.reached_target, status = True, "success"
                            break
                        self.reporter.mlperf.block_start(state.samples)
                    every = self.limits["checkpoint_every_steps"]
                    if every and state.step % every < engine.steps_per_call:
                        self._save()
                    if self.stop.agreed():
                        log.warning("stop requested (signal): checkpointing at step %d", state.step)
                        exit_code = EXIT_INTERRUPTED
                        break
                if (
                    exit_code == 0
                    and not state.reached_target
                    and config["eval"]["at_end"]
                    and self.eval_set is not None
                    and self.evaluated_step != state.step  # not twice for the same weights
                ):
                    if self._evaluate() and config["eval"]["stop_at_target"]:
                        state.reached_target, status = True, "success"
                if self.saved_step != state.step:  # not twice for the same step
                    self._save()
            except Diverged as err:
                print(f"error: {err}", file=sys.stderr)
                exit_code = EXIT_DIVERGED
        finally:
            self._close(status)
        return exit_code

    def _nonfinite(self, what: str) -> None:
        """A step the engine refused (non-finite loss or gradient norm; weights untouched):
        skip it while training.on_nonfinite allows, else stop (Diverged)."""
        # The budget is the run's, kept in checkpoints: a --resume does not reset it.
        self.state.skipped_steps += 1
        self.window_skipped += 1
        policy, allowed = self.limits["on_nonfinite"], self.limits["max_skipped_steps"]
        if policy == "skip" and self.state.skipped_steps <= allowed:
            log.warning("%s: step skipped (%d of at most %d)", what, self.state.skipped_steps, allowed)
            return
        reason = "training.on_nonfinite is stop" if policy == "stop" else f"more than {allowed} skipped steps"
        raise Diverged(f"{what}; stopping ({reason}); the newest checkpoint is the last good one")

    def _limit_reached(self) -> bool:
        state, limits = self.state, self.limits
        if state.step >= limits["max_steps"]:
            return True
        if limits["max_samples"] is not None and state.samples >= limits["max_samples"]:
            return True
        if limits["max_train_seconds"] is not None and self.train_seconds() >= limits["max_train_seconds"]:
            return True
        return (
            limits["max_seconds"] is not None and time.perf_counter() - self.started >= limits["max_seconds"]
        )

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

    def _train_call(self) -> float:
        """One engine call: its micro-batches, the lr for the samples so far, the steps it
        makes; advances the run state. Returns the lr used."""
        state, engine = self.state, self.engine
        micro_batches = [next(self.loader) for _ in range(engine.micro_batches_per_call)]
        if self.config["data"]["validate_batches"]:
            for batch in micro_batches:
                validate_batch(batch, self.model.config.vocab_size, self.model.config.max_position_embeddings)
        lr = self.schedule(state.samples)
        try:
            counts = engine.train(micro_batches, lr, self.window)
        except NonFiniteStep as err:
            self._nonfinite(f"step {state.step + 1}: non-finite {err}")
            counts = torch.zeros(2)  # a skipped step: its data is consumed, nothing learned
        sequences = int(counts[1].item())
        state.step += engine.steps_per_call
        state.samples += sequences
        self.window_samples += sequences
        state.position = advance(
            state.position, engine.micro_batches_per_call * engine.data_world, self.sampler.per_epoch
        )
        self.progress.update(engine.steps_per_call)
        return lr

    # ----- reporting -------------------------------------------------------------------
    def _new_window(self) -> None:
        self.window, self.window_start, self.window_samples = MetricSums(), self.train_seconds(), 0
        self.window_skipped = 0

    def _log_window(self, lr: float) -> None:
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
            "epoch": self.state.position.epoch,
            "lr": lr,
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

    def _evaluate(self) -> bool:
        """Evaluate, log; True when the target MLM accuracy is reached."""
        if self.eval_set is None:
            return False
        state = self.state
        train_seconds = self.train_seconds()
        with self._paused():
            metrics = self.engine.evaluate(*self.eval_set)
        self.evaluated_step = state.step
        state.best_eval_accuracy = max(state.best_eval_accuracy, metrics["mlm_accuracy"])
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
    def _save(self) -> None:
        """Collective: a checkpoint of this step (rank 0 writes it). Never of non-finite weights."""
        self.state.train_seconds = self.train_seconds()
        with self._paused():
            self._write_checkpoint()

    def _write_checkpoint(self) -> None:
        # One reduction on the device, one host sync (not one per parameter).
        bad = not bool(torch.stack([torch.isfinite(p).all() for p in self.model.parameters()]).all())
        if any_process(bad):
            raise Diverged(f"step {self.state.step}: non-finite weights; refusing to checkpoint them")
        snapshot = self.engine.snapshot()
        rng = gather_rng_states()
        if self.engine.rank == 0:
            training_state = {
                **snapshot.engine_state,
                **self.state.to_checkpoint(),
                "rng": rng,
                "config": self.config,
                "data_identity": data_identity(self.config),
            }
            try:
                path = ckpt.save_checkpoint(
                    self.checkpoints,
                    self.state.step,
                    snapshot.model,
                    training_state,
                    self.limits["keep_checkpoints"],
                )
            except ckpt.CheckpointError as err:
                raise RunError(str(err)) from None
            log.info("checkpoint %s", path)
        self.saved_step = self.state.step
        barrier()

    def _close(self, status: str) -> None:
        self.progress.close()
        self.reporter.mlperf.run_stop(self.state.samples, status)
        self.reporter.log(
            {
                "step": self.state.step,
                "samples": self.state.samples,
                "status": status,
                "seconds": time.perf_counter() - self.started,
                "train_seconds": self.train_seconds(),
            },
            "end",
        )
        self.reporter.close()


def forget_metrics_after(path: Path, step: int) -> None:
    """Drop metrics.jsonl lines of steps after `step` (a resumed run logs them again)."""
    if not path.is_file():
        return
    # Complete lines only: a last line cut off by a kill or a full disk is no record.
    kept = [line for line in read_metric_lines(path) if json.loads(line).get("step", 0) <= step]
    with atomic_path(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in kept))


def platform_name(config: dict, engine) -> str:
    """'<processes>x<device>' for the MLPerf log's submission_platform default."""
    device = config["execution"]["device"]
    if device == "cuda":
        device = torch.cuda.get_device_name().replace(" ", "_")
    return f"{engine.data_world}x{device}"


def run(config: dict, output: Path, resume: bool) -> int:
    """The run with the engine the config selects, as a process exit code: user-input and
    environment errors become exit code 2 with one line (run_pretraining.py's contract)."""
    from training.backends import engine_class

    try:
        return run_training(config, output, resume, engine_class(config))
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except PackingInputError as err:  # a shard that changed or breaks the format, found at read time
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, an unwritable or misplaced output folder, ...
        print(f"error: {describe_os_error(err)}", file=sys.stderr)
        return 2
    finally:
        shut_down_process_group()


def run_training(
    config: dict, output: Path, resume: bool = False, engine_class: type[Engine] | None = None
) -> int:
    """The whole run on this process with `engine_class` (default: the torch engine).
    The engine's config checks come first, before any data is opened or hashed.
    Returns the process exit code."""
    if engine_class is None:
        from training.backends.torch_engine import TorchEngine

        engine_class = TorchEngine
    engine_class.check_config(config)
    run = Run(config, output, resume, engine_class)
    return run.compile() if run.compile_only else run.train()
