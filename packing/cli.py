"""`python -m packing ...`: the packing command line.

Exit codes: 0 success, 1 verification found a mismatch, 2 bad user input (a
message, no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys

from packing.algorithms import ALGORITHMS, pack
from packing.errors import PackingInputError
from packing.histogram import Histogram
from packing.plan import parse_max_sequences_per_pack
from packing.report import describe_plan, plot_plan, report_table


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="plan a histogram and print efficiency figures")
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


COMMANDS = {"report": (_add_report, cmd_report)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m packing", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add, _ in COMMANDS.values():
        add(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command][1](args)
    except PackingInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
