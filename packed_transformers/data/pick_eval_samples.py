"""`python -m packed_transformers.data.pick_eval_samples`: the MLPerf BERT evaluation set, picked as the reference's
`pick_eval_samples.py` (mlcommons/training, language_model/tensorflow/bert/cleanup_scripts) picks
it: of the N sequences generated from the held-out Wikipedia text, row floor(i * N / count) for
i = 0 .. count - 1 (count = 10,000), in that order. Nothing random: the seed (12345) is the
generator's, which made the N sequences.

Input: unpacked HDF5 shards or TFRecord files (globs; files in the order given, sorted within
a glob; rows in file order). Output: one unpacked HDF5 shard, `OUTPUT/part-00000.h5`, that
`python -m packed_transformers.packing pack` takes, plus `picked.json` (the source row of every picked sequence).
The folder appears whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from packed_transformers.common.cli import command_parser, refuse
from packed_transformers.common.files import atomic_folder, describe_os_error, write_json_atomic
from packed_transformers.packing.sources import (
    FIELDS,
    Limits,
    describe_problem,
    expand_inputs,
    open_source,
    validate_rows,
)
from packed_transformers.packs.errors import PackingInputError
from packed_transformers.packs.unpacked_hdf5 import write_unpacked_shard

MLPERF_EVAL_SAMPLES = 10_000


def picked_rows(total: int, count: int) -> list[int]:
    """The reference's rows: int(i * (total / count)) in Python floats, not a rounded rational
    (the two differ for some totals, and the reference's is the contract)."""
    ratio = total / count
    return [int(i * ratio) for i in range(count)]


def pick(patterns: list[str], output: Path, count: int, vocab_size: int) -> dict:
    files = expand_inputs(patterns)
    sources = [open_source(path) for path in files]
    total = sum(source.rows for source in sources)
    if count > total:
        # The reference would repeat sequences (ratio < 1); a repeated eval sequence is never wanted.
        raise PackingInputError(f"--count {count} is more than the {total} sequences in --input")
    widths = {(source.width, source.predictions_width) for source in sources if source.rows}
    if len(widths) > 1:
        raise PackingInputError(f"--input files differ in [S, P] widths: {sorted(widths)}")
    rows = picked_rows(total, count)
    starts = np.cumsum([0] + [source.rows for source in sources])
    columns: dict[str, list] = {name: [] for name in FIELDS}
    for index, source in enumerate(sources):
        local = [r - starts[index] for r in rows if starts[index] <= r < starts[index + 1]]
        if local:
            block = source.read(int(local[0]), int(local[-1]) + 1)  # one contiguous read per file
            offsets = np.asarray(local) - local[0]
            picked = {name: block[name][offsets] for name in FIELDS}
            # Checked here, where the source row is known: a bad row is named in its own file,
            # not later as row i of the picked set.
            limits = Limits(source.width, source.predictions_width, vocab_size, " (--vocab-size)")
            _, _, problems = validate_rows(picked, limits, source.path, 0)
            if problems:
                row, field, message = problems[0]
                raise PackingInputError(describe_problem(source.path, int(local[row]), field, message))
            for name in FIELDS:
                columns[name].append(picked[name])
        source.close()
    arrays = {name: np.concatenate(parts) for name, parts in columns.items()}
    with atomic_folder(output) as tmp:
        write_unpacked_shard(tmp / "part-00000.h5", arrays, vocab_size)
        summary = {
            "inputs": [str(path) for path in files],
            "input_sequences": total,
            "picked": count,
            "source_rows": rows,
        }
        write_json_atomic(tmp / "picked.json", summary)
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("python -m packed_transformers.data.pick_eval_samples", __doc__)
    p.add_argument(
        "--input", nargs="+", required=True, metavar="GLOB", help="unpacked HDF5 or TFRecord files"
    )
    p.add_argument("--output", required=True, type=Path, metavar="DIR")
    p.add_argument("--count", type=int, default=MLPERF_EVAL_SAMPLES, help="sequences to pick (MLPerf: 10000)")
    p.add_argument("--vocab-size", type=int, default=30522)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.count < 1:
        return refuse(f"--count must be >= 1, got {args.count}")
    if args.output.exists():
        return refuse(f"--output {args.output} exists; choose a new folder")
    try:
        summary = pick(args.input, args.output, args.count, args.vocab_size)
    except PackingInputError as err:
        return refuse(err)
    except OSError as err:  # an unreadable input, a full disk, an unwritable --output
        return refuse(describe_os_error(err))
    print(json.dumps({k: v for k, v in summary.items() if k != "source_rows"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
