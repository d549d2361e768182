"""`python -m packed_transformers.packing ...`: the packing command line.

Exit codes: 0 success, 1 verification found a mismatch, 2 bad user input (a
message, no traceback).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from packed_transformers.common.cli import DefaultsHelpFormatter, command_parser, refuse
from packed_transformers.packing.pipeline import SKIPPED, PackJob, run_pack
from packed_transformers.packing.report import (
    datasets_table,
    describe_plan,
    plot_plan,
    plot_plans,
    report_table,
)
from packed_transformers.packing.shards import PackedDataset
from packed_transformers.packing.sources import expand_inputs
from packed_transformers.packing.unpack import run_unpack
from packed_transformers.packing.verify import run_verify
from packed_transformers.packs.algorithms import ALGORITHMS, pack
from packed_transformers.packs.errors import PackingInputError
from packed_transformers.packs.histogram import Histogram
from packed_transformers.packs.plan import parse_max_sequences_per_pack


def _add_report(sub, name: str = "report") -> None:
    p = sub.add_parser(
        name, formatter_class=DefaultsHelpFormatter, help="plan a histogram and print efficiency figures"
    )
    p.add_argument("--histogram", required=True, help="JSON {max_sequence_length, counts}")
    p.add_argument(
        "--algorithm",
        choices=sorted(ALGORITHMS),
        help="one algorithm; without it, a table of all algorithms x depths",
    )
    p.add_argument("--max-sequences-per-pack", default="max", help="K: an integer or 'max'")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="length and pack-fill histograms")


def cmd_report(args) -> int:
    histogram = Histogram.from_json_file(args.histogram)
    k = parse_max_sequences_per_pack(args.max_sequences_per_pack)
    if args.algorithm is None:
        if args.json:
            raise PackingInputError("--json needs --algorithm (the table is text only)")
        print(report_table(histogram))
        if args.plot:
            plot_plan(histogram, pack(histogram, "lpfhp", k), args.plot)
        return 0
    plan = pack(histogram, args.algorithm, k)
    print(json.dumps(plan.summary()) if args.json else describe_plan(plan))
    if args.plot:
        plot_plan(histogram, plan, args.plot)
    return 0


def _add_inputs(p) -> None:
    p.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="GLOB",
        help="unpacked shards (HDF5 or TFRecord); repeat for several globs. The order of the "
        "globs, then file names, defines the global sequence index",
    )


def _default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def _add_pack(sub) -> None:
    p = sub.add_parser(
        "pack",
        formatter_class=DefaultsHelpFormatter,
        help="pack unpacked shards into static-shape packed shards",
    )
    _add_inputs(p)
    p.add_argument("--output", required=True, metavar="DIR", help="folder for part-NNNNN.h5 + metadata.json")
    p.add_argument("--algorithm", default="lpfhp", choices=sorted(ALGORITHMS))
    p.add_argument("--max-sequences-per-pack", default="3", help="K: an integer or 'max'")
    p.add_argument("--max-sequence-length", type=int, default=512, help="S, tokens per row")
    p.add_argument("--max-predictions-per-seq", type=int, default=76, help="P of the inputs")
    p.add_argument(
        "--max-predictions-per-pack",
        type=int,
        help="M, masked-LM slots per pack; default: the largest number any pack of this plan needs",
    )
    p.add_argument("--vocab-size", type=int, help="reject token ids >= this (default: no check)")
    p.add_argument("--seed", type=int, default=12345, help="sequence-to-pack assignment and pack order")
    p.add_argument("--workers", type=int, default=_default_workers())
    p.add_argument("--shard-size", type=int, default=1 << 16, metavar="PACKS", help="packs per shard")
    p.add_argument(
        "--skip-invalid",
        action="store_true",
        help=f"skip bad rows instead of stopping; each is listed in {SKIPPED} and counted in metadata.json",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def cmd_pack(args) -> int:
    for name in ("max_sequence_length", "max_predictions_per_seq", "workers", "shard_size"):
        if getattr(args, name) < 1:
            raise PackingInputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_sequence_length > 65535:
        raise PackingInputError("--max-sequence-length must be <= 65535 (position_ids are uint16)")
    job = PackJob(
        inputs=tuple(str(p) for p in expand_inputs(args.input)),
        output=args.output,
        algorithm=args.algorithm,
        max_sequences_per_pack=parse_max_sequences_per_pack(args.max_sequences_per_pack),
        max_sequence_length=args.max_sequence_length,
        max_predictions_per_seq=args.max_predictions_per_seq,
        seed=args.seed,
        shard_size=args.shard_size,
        vocab_size=args.vocab_size,
        max_predictions_per_pack=args.max_predictions_per_pack,
        skip_invalid=args.skip_invalid,
    )
    meta = run_pack(job, workers=args.workers, quiet=args.quiet)
    summary = {
        key: meta[key] for key in ("sequences", "packs", "S", "K", "M", "efficiency", "packing_factor")
    }
    summary.update(shards=len(meta["shards"]), skipped_rows=meta["skipped_rows"], output=str(args.output))
    print(json.dumps(summary))
    return 0


def _add_verify(sub) -> None:
    p = sub.add_parser(
        "verify",
        formatter_class=DefaultsHelpFormatter,
        help="prove every input sequence is packed exactly once, unchanged",
    )
    _add_inputs(p)
    p.add_argument("--packed", required=True, metavar="DIR")
    p.add_argument("--workers", type=int, default=_default_workers())
    p.add_argument("--quiet", action="store_true")


def cmd_verify(args) -> int:
    return run_verify(expand_inputs(args.input), Path(args.packed), workers=args.workers, quiet=args.quiet)


def _add_unpack(sub) -> None:
    p = sub.add_parser(
        "unpack",
        formatter_class=DefaultsHelpFormatter,
        help="write the packed sequences back in the unpacked HDF5 layout",
    )
    p.add_argument("--packed", required=True, metavar="DIR")
    p.add_argument("--output", required=True, metavar="DIR")


def cmd_unpack(args) -> int:
    run_unpack(Path(args.packed), Path(args.output))
    return 0


def _add_describe(sub) -> None:
    p = sub.add_parser(
        "describe",
        formatter_class=DefaultsHelpFormatter,
        help="before/after table of packed datasets (from metadata.json)",
    )
    p.add_argument("--packed", nargs="+", required=True, metavar="DIR")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="the length histogram and every dataset's tokens per pack (same sequences)",
    )


def cmd_describe(args) -> int:
    datasets = {d: PackedDataset.open(d).metadata for d in args.packed}
    print(datasets_table(datasets))
    if args.plot:
        histogram = Histogram(np.asarray(next(iter(datasets.values()))["length_histogram"], dtype=np.int64))
        plans = {}
        for label, meta in datasets.items():
            if not np.array_equal(np.asarray(meta["length_histogram"]), histogram.counts):
                print(f"note: {label} holds other sequences than the first dataset; not plotted")
                continue
            k = parse_max_sequences_per_pack(meta["max_sequences_per_pack"])
            plans[Path(label).name] = pack(histogram, meta["algorithm"], k)
        plot_plans(histogram, plans, args.plot)
        print(f"plot written to {args.plot}")
    return 0


COMMANDS = {
    "describe": (_add_describe, cmd_describe),
    "report": (_add_report, cmd_report),
    "plan": (lambda sub: _add_report(sub, "plan"), cmd_report),  # `packed plan`: report by its own name
    "pack": (_add_pack, cmd_pack),
    "verify": (_add_verify, cmd_verify),
    "unpack": (_add_unpack, cmd_unpack),
}


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("python -m packed_transformers.packing", __doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add, _ in COMMANDS.values():
        add(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command][1](args)
    except PackingInputError as err:
        return refuse(err)
    except OSError as err:  # a full disk, a file-size limit, an unwritable folder, ...
        from packed_transformers.common.files import describe_os_error

        if err.filename is None and getattr(args, "output", None) is not None:
            err = OSError(err.errno, err.strerror or str(err), f"writing into {args.output}")
        return refuse(describe_os_error(err))
