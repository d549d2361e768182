"""The run's setup, in the order it happens: data opened and checked, the engine, the
output folder, the model, a checkpoint restored, the loader, the evaluation set, logging.
Every user-input check comes before config.yaml is written (the last phase)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from packed_transformers.components import run_checkpoint as ckpt_run
from packed_transformers.components.data import PackedShards, ReplicaSampler, eval_batches, make_loader
from packed_transformers.components.errors import RunError
from packed_transformers.components.observe import Reporter
from packed_transformers.components.run_folder import (
    CHANGEABLE_ON_RESUME,
    check_same_run,
    data_identity,
    prepare_output,
    write_run_config,
)
from packed_transformers.components.run_state import BertProgress, EvalSchedule, RunState, StopSignal
from packed_transformers.components.synthetic import SyntheticPacks
from packed_transformers.engines.engine import Engine
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


class RunSetup:
    """The run's construction: every phase before the first step, each a method. `Run`
    (training/run.py) drives what this builds."""

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
            prepare_output(output, config, resume, self.engine.rank, changeable=GLOBAL_BATCH_SPLIT)
        # MLPerf's init phase starts at the model build; its lines are written once every
        # check has passed (no log file for a run that is refused).
        init_started_ms = time.time() * 1000
        self.model = build_model(config, self.limits["seed"])
        if train_data is None:
            train_data = self._synthetic_packs()
        check_model_fits_data(self.model, train_data)
        if eval_data is not None:  # checked like the training data: not hours in, at the first evaluation
            check_model_fits_data(self.model, eval_data, "data.eval_dir")
        resumed = self._restore_checkpoint(resume)
        # What the step is made of, after the packing adjustment (components.step.BatchArithmetic).
        self.arithmetic = self.engine.attach(self.model, packing_factor(train_data))
        self.schedule = build_schedule(config)
        self.state = RunState(extra=BertProgress())
        if resumed is not None:
            self._restore_state(*resumed)
        # what every checkpoint keeps for a resume to check: this run's config, data, packs a step
        record = self.state.extra
        record.config, record.data_identity = config, data_identity(config)
        record.packs_per_step = self.arithmetic.packs_per_step
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
        self.saved_step = self.state.step if resumed is not None else None

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

    def _restore_checkpoint(self, resume: bool) -> tuple[RunState, dict] | None:
        """With --resume: the newest intact checkpoint's weights into the model, this replica's
        RNG state put back, and its run state and training state returned (None without
        --resume). Half-written checkpoints a crash left are removed first."""
        self.checkpoints = self.output / "checkpoints"
        if not resume:
            return None

        def load_checkpoint_weights(path, _state):
            ckpt_run.load_model_weights(self.model, path)

        self.resumed_from, restored, saved = ckpt_run.resume_pretraining(
            self.output, load_checkpoint_weights, BertProgress, self.engine.rank, clean=not self.compile_only
        )
        return restored, saved

    def _restore_state(self, restored: RunState, saved: dict) -> None:
        """The engine's state (optimizer) and the run state, checked against this run's."""
        engine = self.engine
        kept = restored.extra
        # The checkpoint's own record, not only config.yaml (which a user can delete or
        # edit): the same settings, and the same data at the data path.
        if kept.config is not None:
            check_same_run(kept.config, self.config, "the checkpoint", changeable=GLOBAL_BATCH_SPLIT)
            # the global batch may be split another way (other processes, other accumulation:
            # a sharded run resumed on another number of ranks), never changed: the checkpoint
            # records its packs a step (one from before that record: the same accumulation)
            written = kept.packs_per_step
            accumulation = kept.config["optim"]["gradient_accumulation"]
            if written is None and accumulation != self.config["optim"]["gradient_accumulation"]:
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
        before, now = kept.data_identity, data_identity(self.config)
        if before is not None and before != now:
            raise RunError(
                f"--resume: {self.config['data']['train_dir']}/metadata.json has sha256 {str(now)[:12]}..., "
                f"the checkpoint was trained on {before[:12]}...: the data at data.train_dir changed "
                "(re-packed or replaced) since; resume on the data it was trained on, or start a new run"
            )
        engine.load_state(saved, self.resumed_from)
        self.state = restored
        if not self.compile_only:  # lines logged after the checkpoint are trained again
            ckpt_run.forget_lines_after(self.output, self.state.step, engine.rank)

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
                self.state.extra.position,
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
