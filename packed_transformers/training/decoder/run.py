"""The decoder pretraining run: a job of the pretraining runs' one Trainer (components.trainer:
the setup's order, resume, checkpoints), its steps over one typed state.

    rows checked -> model, AdamW (sharded) -> the folder -> the newest intact checkpoint restored
    loop:  global batch of rows (components.decoder_data) -> per micro-batch: forward (the packed
           causal LM's token-loss sum) scaled by 1 / (predicted tokens of the whole step, all
           replicas) -> backward -> gradients summed over replicas -> clip 1.0 -> AdamW at
           the cosine schedule's rate -> log -> evaluate when due -> checkpoint when due
    end:   evaluation, final checkpoint, MLPerf run_stop

The loss of a step is the mean next-token cross-entropy over every predicted token of the
step (a document's last token predicts nothing; in the documents layout no token predicts
across a document), so 1 replica x GA micro-batches and GA replicas x 1 are one computation.
Evaluation: the log perplexity (mean cross-entropy, nats) over the first eval.rows rows.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from packed_transformers.components.decoder_data import evaluation_batches, global_batch_rows, micro_batches
from packed_transformers.components.distributed import all_reduce_, setup_replica
from packed_transformers.components.errors import RunError
from packed_transformers.components.loop import LoopEnd
from packed_transformers.components.run_folder import CHANGEABLE_ON_RESUME
from packed_transformers.components.run_state import EvalSchedule, RunState, plain_values, skip_or_stop
from packed_transformers.components.sharding import materialize_sharded
from packed_transformers.components.step import MeanLoss, NonFiniteStep, predicted_tokens
from packed_transformers.components.trainer import PretrainingTrainer
from packed_transformers.engines.torch_engine import TorchEngine, evaluation_outputs
from packed_transformers.optim import WarmupCosineDecay, weight_decay_groups
from packed_transformers.packs.errors import PackingInputError
from packed_transformers.packs.lm_rows.store import RowStore
from packed_transformers.training.decoder.config import division_fault
from packed_transformers.training.decoder.model import build_decoder

log = logging.getLogger("training")

# Keys that only split the global batch (rows a step): a resume may change them, onto another
# number of processes, as long as the global batch stays (checked against the checkpoint).
GLOBAL_BATCH_SPLIT = CHANGEABLE_ON_RESUME | {("data", "micro_batch_rows"), ("optim", "gradient_accumulation")}


# The causal LM's loss: the mean next-token cross-entropy over every predicted token of the
# step; each micro-batch's detached loss sum kept for the step's record.
TOKEN_LOSS = MeanLoss(
    predicted_tokens, "token_count", lambda out, batch: out["token_loss_sum"].detach().double()
)


@dataclass
class DecoderProgress:
    """The decoder's part of the run state (components.run_state.RunState.extra; its `samples`
    are rows trained on, all replicas: the order's position)."""

    tokens: int = 0  # real tokens trained on, all replicas
    best_log_perplexity: float = math.inf
    rows_per_step: int = 0  # the global batch (0: a checkpoint from before it was recorded)

    @classmethod
    def from_dict(cls, values: dict) -> DecoderProgress:
        return cls(**plain_values(cls, values))


def open_rows(folder, role: str, config: dict) -> RowStore:
    try:
        store = RowStore.open(folder, check_sha256=config["data"]["check_sha256"])
    except PackingInputError as err:
        raise RunError(f"data.{role}_dir: {err}") from None
    length = config["data"]["max_sequence_length"]
    if store.length != length:
        raise RunError(
            f"data.{role}_dir {folder}: S={store.length} in metadata.json, data.max_sequence_length is {length}"
        )
    return store


class DecoderRun(PretrainingTrainer):
    """One process's part of a decoder run: the phases of components.trainer.Trainer's setup,
    then what a step, a logging line and an evaluation are; `train` returns the exit code."""

    progress_type = DecoderProgress
    changeable = GLOBAL_BATCH_SPLIT

    # ----- the setup's phases (components.trainer) ---------------------------------------
    def open_data(self) -> None:
        """The rows (train, eval) checked against the config; the replica; the global batch
        checked against the train rows."""
        config, data = self.config, self.config["data"]
        self.train_rows = open_rows(data["train_dir"], "train", config)
        self.eval_rows = open_rows(data["eval_dir"], "eval", config) if data["eval_dir"] else None
        if self.eval_rows is not None and self.eval_rows.rows < config["eval"]["rows"]:
            raise RunError(
                f"data.eval_dir: holds {self.eval_rows.rows} rows, eval.rows is {config['eval']['rows']}"
            )
        fault = division_fault(config["logging"]["submission_division"], self.train_rows.layout)
        if fault:
            raise RunError(fault)
        self.replica = setup_replica(config)
        self.rank, self.world, self.sharded = self.replica.rank, self.replica.world, self.replica.sharded
        optim = config["optim"]
        self.rows_per_step = data["micro_batch_rows"] * optim["gradient_accumulation"] * self.world
        if self.rows_per_step > self.train_rows.rows:
            raise RunError(
                f"data.micro_batch_rows {data['micro_batch_rows']} x optim.gradient_accumulation "
                f"{optim['gradient_accumulation']} x {self.world} replica(s) = {self.rows_per_step} rows a step: "
                f"data.train_dir holds {self.train_rows.rows} rows (a step would read rows more than once)"
            )

    def build(self) -> None:
        """The model (its memory checked before the run folder is written), placed or sharded,
        AdamW and the step. Sharded from a random init it is built on the meta device (no rank
        holds it whole on its device) and rank 0 builds it on the CPU, as one process would, for
        its weights."""
        config, data = self.config, self.config["data"]
        data_vocab = max(self.train_rows.vocab_size, self.eval_rows.vocab_size if self.eval_rows else 0)
        shape = (config, config["model"]["vocab_size"] or data_vocab, data["max_sequence_length"], data_vocab)
        on_meta = self.sharded and config["model"]["init_checkpoint"] is None and self.world > 1
        self.model = build_decoder(
            *shape, self.replica.device, self.world if self.sharded else 1, meta=on_meta
        )
        if not on_meta:
            self.model = self.model.to(self.replica.device)
        if config["execution"]["activation_checkpointing"]:
            self.model.hf_model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        training, optim = config["training"], config["optim"]
        from torch._dynamo.utils import counters

        # graphs the process compiled before this run (a process may run twice: tests)
        self.graphs_before = counters["stats"]["unique_graphs"]

        def adamw(placed):  # over the placed parameters (sharded from the meta device: given weights first)
            if on_meta:
                whole = build_decoder(*shape, "cpu", weights_only=True).hf_model if self.rank == 0 else None
                materialize_sharded(placed, whole, self.replica.device, self.rank)
            return torch.optim.AdamW(weight_decay_groups(placed.named_parameters(), optim["weight_decay"]),
                                     lr=0.0, betas=tuple(optim["betas"]), eps=optim["eps"])  # fmt: skip

        self.engine = TorchEngine(config, self.replica)
        blocks = self.engine.place(self.model, adamw, training["precision"], training["compile"], optim["max_grad_norm"],
                                   backend=training["compile_backend"])  # fmt: skip
        if self.sharded and self.rank == 0:
            log.info("FSDP2: %d blocks and the model sharded over %d ranks%s", blocks, self.world,
                     " (built on the meta device, rank 0's weights broadcast)" if on_meta else "")  # fmt: skip
        self.schedule = WarmupCosineDecay(
            optim["lr"], optim["warmup_samples"], optim["total_samples"], optim["end_lr"]
        )

    def load_checkpoint(self, path: Path, saved: dict) -> None:
        """A checkpoint's weights and optimizer state, whichever way it was written: a sharded
        run's dcp/ or model/ and the optimizer whole, on any number of ranks, sharded or not
        (engines.torch_engine.TorchEngine.restore)."""
        self.engine.restore(path, saved, self.model.hf_model)

    def make_eval_schedule(self) -> EvalSchedule:
        # no evaluation set: never due
        return EvalSchedule((self.config["eval"]["every_samples"] or 0) if self.eval_rows else 0)

    def check_resume(self, path: Path, restored: RunState) -> None:
        written = restored.extra.rows_per_step
        if written and written != self.rows_per_step:
            raise RunError(
                f"--resume: {written} rows a step in {path}, {self.rows_per_step} now "
                "(data.micro_batch_rows x optim.gradient_accumulation x processes must stay the global batch)"
            )

    def record_progress(self, progress: DecoderProgress) -> None:
        progress.rows_per_step = self.rows_per_step

    def start_reporting(self) -> None:
        platform = f"{self.world}x{self.replica.device.type}"
        self.reporter.mlperf.init_benchmark("llama31_8b", self.config["logging"], platform, self.init_started_ms,
                                            self._mlperf_settings(), self.train_rows.rows,
                                            self.config["eval"]["rows"] if self.eval_rows else 0)  # fmt: skip

    def snapshot(self):
        """The engine's: dcp/ where sharded; model/ the transformers model's weights, saved by the
        packed decoder's save_pretrained unsharded."""
        return self.engine.snapshot(self.model.hf_model, self.model.save_pretrained)

    # ----- the MLPerf log -----------------------------------------------------------------
    def _mlperf_settings(self) -> dict:
        optim = self.config["optim"]
        return {
            "global_batch_size": self.rows_per_step,
            "max_sequence_length": self.config["data"]["max_sequence_length"],
            "opt_name": "adamw",
            "opt_base_learning_rate": optim["lr"],
            "opt_end_learning_rate": optim["end_lr"],
            "opt_learning_rate_warmup_steps": optim["warmup_samples"],
            "opt_learning_rate_decay_steps": optim["total_samples"] - optim["warmup_samples"],
            "opt_learning_rate_decay_schedule": "cosine with linear warmup",
            "opt_adamw_beta_1": optim["betas"][0],
            "opt_adamw_beta_2": optim["betas"][1],
            "opt_adamw_epsilon": optim["eps"],
            "opt_adamw_weight_decay": optim["weight_decay"],
            "opt_gradient_clip_norm": optim["max_grad_norm"],
            "gradient_accumulation_steps": optim["gradient_accumulation"],
            "max_steps": optim["total_samples"],
            "seed": self.config["training"]["seed"],
        }

    # ----- the step -----------------------------------------------------------------------
    def _step(self) -> dict:
        """One optimizer step (engines.torch_engine.take_step over this process's micro-batches);
        Diverged for a non-finite one."""
        config, state = self.config, self.state
        indices = global_batch_rows(
            self.train_rows.rows, config["data"]["shuffle_seed"], state.samples, self.rows_per_step
        )
        from packed_transformers.model.families import next_token_targets

        batches = list(
            micro_batches(self.train_rows, indices, self.rank, self.world, config["data"]["micro_batch_rows"])
        )
        for batch in batches:  # each token's next-token target inside its own document
            batch["shift_labels"] = next_token_targets(batch["input_ids"], batch["sequence_ids"])
        lr = self.schedule(state.samples)
        try:
            result = self.engine.step(batches, TOKEN_LOSS, lr)
        except NonFiniteStep as err:
            skip_or_stop(f"step {state.step + 1}", err, 1)  # raises Diverged
        # the step's loss sum and real tokens, every process's: one copy to the host, one collective
        real = sum(int((b["sequence_ids"] > 0).sum()) for b in batches)
        sums = all_reduce_(torch.stack([torch.stack(result.kept).sum().cpu(), torch.tensor(float(real))]))
        loss_sum, tokens = float(sums[0]), int(sums[1])
        state.step += 1
        state.samples += self.rows_per_step
        state.extra.tokens += tokens
        return {"step": state.step, "samples": state.samples, "tokens": state.extra.tokens,
                "loss": loss_sum / max(float(result.units[0]), 1.0),
                "lr": lr, "grad_norm": float(result.grad_norm), "step_tokens": tokens}  # fmt: skip

    def log_perplexity(self) -> float:
        """Log perplexity (nats per predicted token) over the first eval.rows rows."""
        from packed_transformers.model.families import next_token_targets

        sums = torch.zeros(2, dtype=torch.float64)
        rows, per = self.config["eval"]["rows"], self.config["data"]["micro_batch_rows"]
        batches = list(evaluation_batches(self.eval_rows, rows, self.rank, self.world, per))
        # every rank runs as many forwards as rank 0 (which holds the most rows) where sharded; a
        # rank short of rows repeats the first evaluation row and counts nothing of it
        most = -(-len(range(0, rows, self.world)) // per) if self.sharded else len(batches)
        spare = next(evaluation_batches(self.eval_rows, 1, 0, 1, 1)) if len(batches) < most else None

        def with_targets(batch: dict) -> dict:  # each token's next-token target inside its own document
            return {**batch, "shift_labels": next_token_targets(batch["input_ids"], batch["sequence_ids"])}

        for out, _ in evaluation_outputs(self.model, batches, with_targets, most, spare, self.replica.device,
                                         self.config["training"]["precision"]):  # fmt: skip
            sums += torch.tensor(
                [float(out["token_loss_sum"]), float(out["token_count"])], dtype=torch.float64
            )
        all_reduce_(sums)
        return float(sums[0] / max(float(sums[1]), 1.0))

    def _evaluate_and_log(self) -> bool:
        """Evaluate, log; True when the target is reached."""
        value = self.log_perplexity()
        state = self.state
        state.extra.best_log_perplexity = min(state.extra.best_log_perplexity, value)
        self.reporter.log({"step": state.step, "samples": state.samples, "tokens": state.extra.tokens,
                           "log_perplexity": value}, prefix="eval")  # fmt: skip
        self.reporter.mlperf.evaluation(state.samples, value, count_key="samples_count")
        if self.rank == 0:
            log.info("eval at step %d (%d samples): log perplexity %.4f", state.step, state.samples, value)
        reached = value <= self.config["eval"]["target_log_perplexity"]
        state.reached_target = state.reached_target or reached
        return reached

    # ----- the loop (components.loop.run_loop decides when; these methods say what) ------
    def begin(self) -> None:
        self.window_tokens, self.window_start, self.record = 0, time.perf_counter(), None

    def train_call(self) -> None:
        self.record = self._step()
        self.window_tokens += self.record.pop("step_tokens")

    def log_due(self) -> bool:
        limits = self.config["training"]
        return self.state.step % limits["log_every_steps"] == 0 or self.state.step == limits["max_steps"]

    def log_window(self) -> None:
        record = self.record
        record["tokens_per_second"] = self.window_tokens / max(time.perf_counter() - self.window_start, 1e-9)
        self.reporter.log(record)
        if self.rank == 0:
            log.info("step %d: loss %.4f, lr %.3g, %.0f tokens/s", record["step"], record["loss"], record["lr"],
                     record["tokens_per_second"])  # fmt: skip
        self.window_tokens, self.window_start, self.record = 0, time.perf_counter(), None

    def flush_window(self) -> None:
        if self.record is not None:
            self.log_window()

    def evaluate(self) -> bool:
        return self._evaluate_and_log()

    def evaluates_at_end(self) -> bool:
        return self.eval_rows is not None

    def end_figures(self) -> dict:
        return {"tokens": self.state.extra.tokens}

    def close(self, end: LoopEnd) -> None:
        super().close(end)
        if self.engine.step_model is not self.model and self.rank == 0:
            from torch._dynamo.utils import counters

            compiled = counters["stats"]["unique_graphs"] - self.graphs_before
            log.info("torch.compile: %d graph(s) compiled for the run", compiled)


def run_decoder(config: dict, output: Path, resume: bool) -> int:
    """run_pretraining.py's entry for a decoder config: exit code (2: refused, nothing trained)."""
    from packed_transformers.components.run_state import exit_code_of

    return exit_code_of(lambda: DecoderRun(config, output, resume).train())
