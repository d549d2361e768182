"""Packing-aware hyperparameters (Krell et al. 2021, section 4.3).

With packing, each micro-batch of packs carries p times more sequences (p = packing
factor = sequences / packs, about 2 on Wikipedia-512). Two ways keep convergence:

* `same_sequences_per_step`: gradient accumulation := max(1, round(GA / p)). The
  number of sequences per optimizer step stays (approximately) what it was; every
  other hyperparameter is unchanged. Exact up to the rounding of GA / p.
* `same_packs_per_step`: keep the batch of packs (p times more sequences per step) and
  raise the moment decays to beta1^p, beta2^p; learning rate unchanged.

  What is exact: with a constant gradient g, p Adam/LAMB moment updates with
  (beta1, beta2) leave m and v exactly where ONE update with (beta1^p, beta2^p)
  leaves them: m_p = beta1^p m_0 + (1 - beta1^p) g, and likewise for v with g^2.
  Bias-correction terms match too: 1 - (beta^p)^t = 1 - beta^(p t).
  What is a heuristic: real gradients differ from step to step, p need not be an
  integer, and the weights move p times in the unpacked run but once here; the
  paper shows this works in practice for BERT pretraining, nothing more.
* `none`: change nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PACKING_ADJUSTMENTS = ("none", "same_sequences_per_step", "same_packs_per_step")


@dataclass(frozen=True)
class AdjustedHyperparameters:
    mode: str
    packing_factor: float
    gradient_accumulation: int
    betas: tuple[float, float]

    def describe(self) -> str:
        return (
            f"packing adjustment {self.mode}: packing factor {self.packing_factor:.4f}, "
            f"gradient accumulation {self.gradient_accumulation}, "
            f"betas ({self.betas[0]:.6f}, {self.betas[1]:.6f})"
        )


def check_packing_factor(packing_factor) -> float:
    if isinstance(packing_factor, bool) or not isinstance(packing_factor, (int, float)):
        raise ValueError(f"packing factor must be a number >= 1, got {packing_factor!r}")
    if not math.isfinite(packing_factor) or packing_factor < 1.0:
        raise ValueError(
            f"packing factor must be finite and >= 1 (sequences per pack), got {packing_factor!r}"
        )
    return float(packing_factor)


def adjust_for_packing(
    mode: str, packing_factor: float, gradient_accumulation: int, betas: tuple[float, float]
) -> AdjustedHyperparameters:
    """The effective accumulation and betas for a dataset of packing factor p >= 1."""
    if mode not in PACKING_ADJUSTMENTS:
        raise ValueError(f"packing adjustment mode must be one of {PACKING_ADJUSTMENTS}, got {mode!r}")
    p = check_packing_factor(packing_factor)
    if (
        isinstance(gradient_accumulation, bool)
        or not isinstance(gradient_accumulation, int)
        or gradient_accumulation < 1
    ):
        raise ValueError(f"gradient accumulation must be an integer >= 1, got {gradient_accumulation!r}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must both be in [0, 1), got {betas!r}")
    if mode == "same_sequences_per_step":
        return AdjustedHyperparameters(mode, p, max(1, round(gradient_accumulation / p)), tuple(betas))
    if mode == "same_packs_per_step":
        return AdjustedHyperparameters(mode, p, gradient_accumulation, (betas[0] ** p, betas[1] ** p))
    return AdjustedHyperparameters(mode, p, gradient_accumulation, tuple(betas))


def packing_factor_from_metadata(metadata: dict) -> float:
    """The measured packing factor of a packed dataset's metadata.json (already parsed)."""
    if "packing_factor" not in metadata:
        raise ValueError("metadata.json has no 'packing_factor' field")
    return check_packing_factor(metadata["packing_factor"])
