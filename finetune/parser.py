"""finetune.train's argument parser, standard library only: parsed before torch is
imported, so --help and a mistyped option are answered at once (commands/parsers.py holds
the inference commands' parsers the same way)."""

from __future__ import annotations

import argparse
from pathlib import Path

from common.cli import command_parser


def train_parser(doc: str) -> argparse.ArgumentParser:
    """finetune.train's options."""
    parser = command_parser("python -m finetune.train", doc)
    parser.add_argument("--config", required=True, help="fine-tuning YAML (see configs/README.md)")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument(
        "--resume", action="store_true", help="continue the run in --output-dir from its checkpoint (exactly)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a previous run in --output-dir (its files only)"
    )
    return parser
