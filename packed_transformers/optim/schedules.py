"""The learning-rate schedules of every training run. Pretraining's are functions of SAMPLES
seen (real sequences, never packs), so that packed and unpacked runs follow the same curve
per sequence trained: BERT's WarmupPolyDecay, the decoder's WarmupCosineDecay. Fine-tuning's
WarmupLinearDecay counts optimizer steps (its length is set in epochs)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmupPolyDecay:
    """Linear warmup to `peak_lr`, then polynomial decay to `end_lr` at `total_samples`.

    The MLPerf reference (TF `polynomial_decay` + linear warmup) form:
        s   = samples - start_offset_samples      (offset <= 0: NVIDIA's negative
                                                   start_warmup_step, warmup already partly done)
        lr  = peak_lr * s / warmup_samples                                    if s < warmup
        lr  = (peak_lr - end_lr) * (1 - min(s, total) / total) ** power + end_lr   otherwise
    """

    peak_lr: float
    warmup_samples: float
    total_samples: float
    power: float = 1.0
    end_lr: float = 0.0
    start_offset_samples: float = 0.0

    def __post_init__(self):
        for name in ("peak_lr", "warmup_samples", "total_samples", "power", "end_lr"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"WarmupPolyDecay.{name} must be finite and >= 0, got {value!r}")
        if self.total_samples <= 0:
            raise ValueError("WarmupPolyDecay.total_samples must be > 0")
        if self.start_offset_samples > 0 or not math.isfinite(self.start_offset_samples):
            raise ValueError(f"start_offset_samples must be <= 0, got {self.start_offset_samples!r}")

    def __call__(self, samples: float) -> float:
        s = samples - self.start_offset_samples
        if s < self.warmup_samples:
            return self.peak_lr * s / self.warmup_samples
        progress = min(s, self.total_samples) / self.total_samples
        return (self.peak_lr - self.end_lr) * (1.0 - progress) ** self.power + self.end_lr


@dataclass(frozen=True)
class WarmupCosineDecay:
    """Linear warmup to `peak_lr`, then a cosine from `peak_lr` to `end_lr` at `total_samples`
    (end_lr after it): MLPerf Training 5.1's llama31_8b schedule, counted in samples (rows).

        lr = peak_lr * (samples + 1) / warmup_samples                      if samples < warmup
        lr = end_lr + (peak_lr - end_lr) * (1 + cos(pi * p)) / 2            otherwise,
             p = min(1, (samples - warmup) / max(total - warmup, 1))

    The warmup counts the step's own samples (+1: a step at 0 samples trains at a rate above
    zero), as the decoder run always has."""

    peak_lr: float
    warmup_samples: float
    total_samples: float
    end_lr: float = 0.0

    def __call__(self, samples: float) -> float:
        warmup, total = self.warmup_samples, self.total_samples
        if samples < warmup:
            return self.peak_lr * (samples + 1) / warmup
        progress = min(1.0, (samples - warmup) / max(total - warmup, 1))
        return self.end_lr + 0.5 * (self.peak_lr - self.end_lr) * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class WarmupLinearDecay:
    """Linear warmup to `peak_lr`, then linear decay to 0 at `total`: fine-tuning's schedule,
    counted in optimizer steps (a fine-tuning batch's examples vary with packing; its epochs
    are what a user sets, and the step count follows from them).

        fraction = (step + 1) / warmup                          if step < warmup
        fraction = max(0, (total - step) / max(1, total - warmup))   otherwise
        lr = peak_lr * fraction

    The warmup counts the step's own count (+1), as WarmupCosineDecay does; calling it with the
    steps taken gives the next step's rate."""

    peak_lr: float
    warmup: int
    total: int

    def fraction(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        return max(0.0, (self.total - step) / max(1, self.total - self.warmup))

    def __call__(self, step: int) -> float:
        return self.peak_lr * self.fraction(step)
