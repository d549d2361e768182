"""What a run reports: exact metric sums, a JSON-lines file, TensorBoard, MLPerf log lines.

Only rank 0 writes. Metrics are carried as sums and counts (ARCHITECTURE.md section 4) and
all-reduced before they are divided, so accumulation and replicas never average means.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from packed_transformers.components.distributed import all_reduce_host
from packed_transformers.components.mlperf_log import MlperfLog
from packed_transformers.components.step import loss_scales, micro_batch_loss

SUM_KEYS = ("mlm_loss_sum", "mlm_count", "mlm_correct", "nsp_loss_sum", "nsp_count", "nsp_correct", "tokens")


def sums_vector(out: dict, tokens: int) -> torch.Tensor:
    """A micro-batch's SUM_KEYS as one float64 vector on its outputs' device: the model's sums
    (detached), then its real tokens counted on the host (no device sync)."""
    model_sums = torch.stack([out[key].detach().double() for key in SUM_KEYS[:-1]])
    return torch.cat([model_sums, model_sums.new_tensor([float(tokens)])])


class MetricSums:
    """Running float64 sums of SUM_KEYS, kept on the model's device.

    Adding never reads a value back to the host (no device sync per micro-batch); the
    sums reach the host once, in reduce, at logging time. Exact for counts < 2^53."""

    def __init__(self):
        self.totals: torch.Tensor | None = None

    def add(self, out: dict, tokens: int) -> None:
        self.add_vector(sums_vector(out, tokens))

    def add_vector(self, values: torch.Tensor) -> None:
        """Add sums already stacked in SUM_KEYS order (a compiled graph's output)."""
        values = values.double()
        self.totals = values if self.totals is None else self.totals + values

    def reduce(self, sum_over_processes=all_reduce_host) -> dict:
        """The sums of every process, as floats by SUM_KEYS: the one metric reduction of
        every engine (torch.distributed by default; the IPU engine passes Horovod's)."""
        totals = self.totals if self.totals is not None else torch.zeros(len(SUM_KEYS), dtype=torch.float64)
        return dict(zip(SUM_KEYS, sum_over_processes(totals.cpu()).tolist()))


def summarize(totals: dict) -> dict:
    """Sums -> the reported figures: losses per token / per sequence, accuracies."""
    mlm_scale, nsp_scale = loss_scales((totals["mlm_count"], totals["nsp_count"]))
    return {
        # The step's own normalisation (components.step), over the whole window.
        "loss": micro_batch_loss(totals["mlm_loss_sum"], totals["nsp_loss_sum"], mlm_scale, nsp_scale),
        "mlm_loss": totals["mlm_loss_sum"] * mlm_scale,
        "nsp_loss": totals["nsp_loss_sum"] * nsp_scale,
        "mlm_accuracy": totals["mlm_correct"] / max(totals["mlm_count"], 1),
        "nsp_accuracy": totals["nsp_correct"] / max(totals["nsp_count"], 1),
        "sequences": int(totals["nsp_count"]),
        "masked_tokens": int(totals["mlm_count"]),
    }


class Reporter:
    """metrics.jsonl + TensorBoard + MLPerf log (`mlperf`, components.mlperf_log) on rank 0; silent elsewhere."""

    def __init__(self, output: Path, config: dict, rank: int):
        self.enabled = rank == 0
        self.output = output
        self.tb = None
        self.mlperf = MlperfLog(None)  # silent unless rank 0 with logging.mlperf
        if not self.enabled:
            return
        self.metrics = open(output / "metrics.jsonl", "a", buffering=1)
        if config["logging"]["tensorboard"]:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(output / "tensorboard"))
        self.mlperf = MlperfLog(output / "mlperf.log" if config["logging"]["mlperf"] else None)

    def log(self, record: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        # Strict JSON: a non-finite figure is written as null, never as a bare NaN.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.metrics.write(json.dumps({"kind": prefix, **clean}, allow_nan=False) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "samples"):
                    self.tb.add_scalar(f"{prefix}/{key}", value, record.get("samples", 0))

    def close(self) -> None:
        self.mlperf.close()
        if self.enabled:
            self.metrics.close()
            if self.tb is not None:
                self.tb.close()
