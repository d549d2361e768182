"""What one packed forward gives back and what a pass of them counts: the figures every
runner keeps (inference.runner's torch Runner, inference.graph_runner's exported graph).
numpy only."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np


@dataclass
class RunBatch:
    """One forward: the rows it ran (pack_rows' int64 arrays) and the model's outputs asked
    for, float32 numpy ([rows, K, ...] per slot, or [rows, width] per token)."""

    rows: dict
    outputs: dict


@dataclass
class RunStats:
    batches: int = 0
    seconds: float = 0.0  # forward time, device synchronised by the copy to host
    sequences: int = 0
    real_tokens: int = 0
    row_tokens: int = 0  # rows x width: what the model computed on

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / max(self.row_tokens, 1)

    def count(self, table: np.ndarray, width: int, token_ids: list, seconds: float) -> None:
        """One forward over `table`'s rows of `width` tokens, taking `seconds`."""
        self.seconds += seconds
        self.batches += 1
        present = table[table >= 0]
        self.sequences += len(present)
        self.real_tokens += int(sum(len(token_ids[i]) for i in present))
        self.row_tokens += len(table) * width


class RunsTables:
    """What every runner does with a pass's tables, written once: each through its `forward`
    in turn (a generator: the caller may consume batch by batch)."""

    def run(
        self, token_ids: list, tables: Iterable[np.ndarray], width_of: Callable[[np.ndarray], int],
        segment_ids: list | None = None, outputs: Iterable[str] = ("logits",),
    ) -> Iterator[RunBatch]:  # fmt: skip
        outputs = tuple(outputs)
        for table in tables:
            yield self.forward(token_ids, table, width_of(table), segment_ids, outputs)
