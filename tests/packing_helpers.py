"""A small synthetic length histogram and its shapes, for the data-pipeline tests.

Shared by several test modules (no test module imports another)."""

from __future__ import annotations

import numpy as np

S, P = 128, 20


def small_counts() -> np.ndarray:
    """A bimodal length histogram over 1..S (many short, many full-length sequences)."""
    lengths = np.arange(1, S + 1)
    return (50 * np.exp(-((lengths - 30) ** 2) / 200) + 5 + 80 * (lengths == S)).astype(np.int64)
