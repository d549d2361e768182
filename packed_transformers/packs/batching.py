"""Four ways to batch a classification dataset, one code path for the model.

Every mode turns a dataset into a list of batch tables: int64 [rows, K] of example
indices (-1 = empty slot). A table becomes the model's rows through packs.rows.pack_rows
(fine-tuning's training batches: components.batches.collate, rows and labels), so padded,
dynamic, uniform and packed batches are the same fields through the same
PackedBertForSequenceClassification:

| mode    | K | row width              | order in training                              |
|---------|---|------------------------|------------------------------------------------|
| padded  | 1 | max_sequence_length    | shuffled examples, batch_size per batch        |
| dynamic | 1 | longest in the batch   | shuffled examples, batch_size per batch        |
| uniform | 1 | longest in the batch   | length-sorted buckets of batch_size, batches shuffled |
| packed  | K | pack_length            | packs (SPFHP/LPFHP/lp) shuffled, packs_per_batch |

For inference (shuffle=False) padded/dynamic keep input order, uniform sorts by length,
packed keeps its pack order; outputs go back to input order through the example indices.
Every example is in exactly one slot of an epoch; nothing is dropped (the last batch may
be short, or padded with empty rows when pad_last_batch is set).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packed_transformers.common.choices import BATCHING_MODES, FIXED_WIDTH_MODES
from packed_transformers.packs.errors import PackingInputError
from packed_transformers.packs.rows import pad_table, unpacked_table
from packed_transformers.packs.tokenized import check_table, pack_examples


@dataclass(frozen=True)
class BatchingSpec:
    mode: str
    batch_size: int  # examples per batch (packed: packs = round(batch_size / packing factor))
    max_sequence_length: int  # tokens; the padded row width (and the pack length by default)
    max_per_pack: int | None = None  # K, packed mode only; None: from the lengths (fitting_depth)
    algorithm: str = "lpfhp"
    pad_last_batch: bool = False
    pack_length: int | None = None  # packed row width; any value >= the longest example

    @property
    def fixed_width(self) -> int:
        """Row width in tokens of the fixed-width modes (padded, packed)."""
        if self.mode == "packed" and self.pack_length is not None:
            return self.pack_length
        return self.max_sequence_length


class Batcher:
    """Holds a dataset's lengths (and, packed, its packs); hands out one epoch of tables."""

    def __init__(self, lengths: np.ndarray, spec: BatchingSpec, seed: int):
        if spec.mode not in BATCHING_MODES:
            raise ValueError(f"batching mode must be one of {BATCHING_MODES}, got {spec.mode!r}")
        self.spec, self.seed = spec, seed
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if spec.mode == "packed":
            longest = int(self.lengths.max())
            if longest > spec.fixed_width:
                raise PackingInputError(
                    f"batching.pack_length {spec.fixed_width} is shorter than the longest example "
                    f"({longest} tokens); set it to at least {longest}"
                )
            # Packed once (the plan is a property of the length histogram); each epoch shuffles packs.
            self.table = pack_examples(
                self.lengths, spec.fixed_width, spec.max_per_pack, spec.algorithm, seed
            )
            factor = len(self.lengths) / len(self.table)
            self.rows_per_batch = max(1, round(spec.batch_size / factor))
        else:
            self.table = unpacked_table(len(self.lengths))
            self.rows_per_batch = spec.batch_size

    def packing_note(self, asked: int | None) -> str:
        """ ", K=16 (chosen from the lengths), 1.0% padding" for packed batching, with a wider
        pack where one pads less (fine-tuning's log); "" otherwise. asked: the K the user set."""
        from packed_transformers.packs.tokenized import wider_packs

        if self.spec.mode != "packed":
            return ""
        how = "chosen from the lengths" if asked is None else f"at most {asked}"
        padding = self.padding_fraction([self.table])  # every pack of an epoch, in any order
        note = f", K={self.table.shape[1]} ({how}), {padding:.1%} padding"
        if self.spec.pack_length is None:  # the default width: say where a wider one would pad less
            wider = wider_packs(self.lengths, self.spec.fixed_width, padding)
            if wider is not None:
                note += (
                    f" (packs of {wider.pack_length} tokens would leave {wider.padding:.1%}: "
                    f"set batching.pack_length: {wider.pack_length})"
                )
        return note

    @property
    def batches_per_epoch(self) -> int:
        """len(self.epoch(e)) for every e, without building one."""
        return -(-len(self.table) // self.rows_per_batch)

    @property
    def packing_factor(self) -> float:
        return len(self.lengths) / len(self.table)

    def epoch(self, epoch: int, shuffle: bool = True) -> list[np.ndarray]:
        """The batch tables of one epoch; a different order per epoch, fixed by the seed."""
        rng = np.random.default_rng([self.seed, epoch])
        table, rows = self.table, self.rows_per_batch
        if self.spec.mode == "uniform":
            # Sort by length (random tie order when shuffling), cut, then shuffle the batches.
            tie = rng.permutation(len(table)) if shuffle else np.arange(len(table))
            table = table[tie[np.argsort(self.lengths[tie], kind="stable")]]
            batches = [table[i : i + rows] for i in range(0, len(table), rows)]
            if shuffle:
                batches = [batches[i] for i in rng.permutation(len(batches))]
        else:
            if shuffle:
                table = table[rng.permutation(len(table))]
            batches = [table[i : i + rows] for i in range(0, len(table), rows)]
        if self.spec.pad_last_batch and batches:
            # The short batch may sit anywhere after shuffling; pad whichever it is.
            batches = [pad_table(b, rows) if len(b) < rows else b for b in batches]
        check_table(np.concatenate(batches), len(self.lengths))
        return batches

    def width(self, table: np.ndarray) -> int:
        """Row width in tokens of a batch: fixed for padded/packed, its longest example else."""
        if self.spec.mode in FIXED_WIDTH_MODES:
            return self.spec.fixed_width
        present = table[table >= 0]
        return int(self.lengths[present].max()) if present.size else 1

    def padding_fraction(self, batches: list[np.ndarray]) -> float:
        """Fraction (0..1) of the token slots of these batches that are padding."""
        slots = sum(len(b) * self.width(b) for b in batches)
        real = sum(int(self.lengths[b[b >= 0]].sum()) for b in batches)
        return 1.0 - real / slots


# Packed row widths (tokens) inference starts from: a text goes to the narrowest that holds
# it (width_groups), the longest width being the model's maximum.
PACK_WIDTHS = (64, 128, 256, 512)


def width_groups(
    lengths: np.ndarray, longest: int, max_per_pack: int | None, algorithm: str, hidden: int
) -> list:
    """[(text indices, row width)]: which texts are packed together, into rows how wide.

    Each text starts in the narrowest of PACK_WIDTHS (those below `longest`, then `longest`)
    that holds it; some neighbouring groups are then
    merged into the wider one, where texts that filled their own rows badly (texts of 109
    tokens alone in 128-token rows) pack with others. Of the 2^(widths-1) ways to merge, the
    one of least estimated work is kept: per packed row of width W, W x (24 H + 4 W)
    multiply-adds per layer and unit of H (the dense layers' 24 H^2 per token, and the
    block-diagonal attention's 4 W H). Measured on BBC paragraphs (median 109 tokens):
    0.73 real tokens and 1.45x the time of sorting with the narrowest width alone, 0.99+ and
    no slower than sorting with this choice (docs/embeddings.md)."""
    widths = [w for w in PACK_WIDTHS if w < longest] + [longest]
    group_of = np.searchsorted(widths, lengths)  # the narrowest width >= each length
    members_of = [np.flatnonzero(group_of == g) for g in range(len(widths))]
    best, best_cost = None, None
    for merges in range(2 ** (len(widths) - 1)):  # bit g: group g joins group g + 1
        parts, carried = [], np.zeros(0, dtype=np.int64)
        for g, width in enumerate(widths):
            members = np.concatenate([carried, members_of[g]])
            if g < len(widths) - 1 and merges >> g & 1:
                carried = members
                continue
            if len(members):
                parts.append((np.sort(members), width))
            carried = np.zeros(0, dtype=np.int64)
        cost = 0
        for members, width in parts:
            rows = len(pack_examples(lengths[members], width, max_per_pack, algorithm, seed=0))
            cost += rows * width * (24 * hidden + 4 * width)
        if best_cost is None or cost < best_cost:
            best, best_cost = parts, cost
    return best
