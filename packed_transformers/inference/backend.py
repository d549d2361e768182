"""One packed forward per runtime behind one interface (issue 106; in the spirit of
text-embeddings-inference's `Backend`): numpy packed rows in, numpy outputs out by name, and
what the Runner must know about row shapes. numpy only: an exported folder's process runs it.

    rows      packs.rows.pack_rows' fields, int64 [rows, width] (slots [rows, K])
    outputs   float32 by name: [rows, K, ...] per slot, or [rows, width, ...] per token

    Backend          the interface inference.runner's Runner asks, and nothing else
    TorchBackend     inference.torch_backend: the packed model in torch (float32, bf16 autocast,
                     int8 through fbgemm; torch.compile per row shape)
    OnnxGraphs       inference.onnx_graphs: the packed model exported to ONNX Runtime once
    OpenVinoGraphs   inference.openvino_graphs: converted to OpenVINO once, compiled once (bounded shapes)
    SessionBackend   here: an exported folder's graph in its runtime's session (no torch)

The runtime is chosen once, in inference.runner.backend_of (a torch model) or
inference.exported_backend (an exported folder); no caller compares runtime names to run a
forward. RunBatch and RunStats: what one forward gives back and what a pass counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

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


# (batch tensors, model outputs) -> {name: numpy}: a reduction on the device in place of whole
# outputs (a causal LM's [rows, width, vocabulary] logits); torch backends only
Read = Callable[[dict, dict], dict]
# batch tensors -> the model's inputs beyond the rows (a causal LM's next-token targets)
ExtraInputs = Callable[[dict], dict]


class Backend(Protocol):
    """A model's packed forward in one runtime. Implementations subclass it: nothing to
    calibrate unless they say so (`calibrated` True, `calibrate` a no-op)."""

    runtime: str  # "torch" | "onnxruntime" | "openvino"
    dtype: str  # "float32" | "bfloat16" | "int8"
    # True: every forward at a row width has one shape (the Runner pads that width's tables to
    # its most rows and slots): a graph compiled per shape (torch.compile)
    fixed_shapes: bool
    calibrated: bool = True  # False: a static int8 graph that `calibrate` must see before its first rows

    def calibrate(self, rows: list[dict]) -> None:
        """Static int8: quantize on packed `rows` of texts like those to come (once); by
        default there is nothing to calibrate."""
        return None

    def __call__(
        self,
        rows: dict,
        outputs: tuple[str, ...],
        read: Read | None = None,
        inputs: ExtraInputs | None = None,
    ) -> dict:
        """One batch of rows -> {name: float32 numpy} of `outputs` (or what `read` reduces)."""


def graph_reads_whole(read: Read | None, inputs: ExtraInputs | None) -> None:
    """A graph runtime answers its outputs whole: `read` and `inputs` (a causal LM's, which no
    graph runtime runs) refused."""
    if read is not None or inputs is not None:
        raise ValueError("a graph runtime answers its outputs whole (no read / inputs: torch only)")


@dataclass
class SessionBackend(Backend):
    """An exported folder's graph in its runtime's session (inference.onnx_session or
    .openvino_session, numpy in and out): as exported, nothing to calibrate, each row shape
    as it comes (an exported OpenVINO graph is compiled once, at its first batch)."""

    session: object  # OnnxSession | OpenVinoSession
    runtime: str
    dtype: str
    fixed_shapes = False

    def __call__(self, rows: dict, outputs: tuple[str, ...], read=None, inputs=None) -> dict:
        graph_reads_whole(read, inputs)
        answer = self.session(rows)
        return {name: answer[name] for name in outputs}
