"""`packed`: the toolkit's one command; each subcommand is a job.

    packed pack --input 'unpacked/part-*.h5' --output packed --algorithm lp ...
    packed verify --input 'unpacked/part-*.h5' --packed packed
    packed pretrain --config configs/demo.yaml --output-dir runs/demo
    packed train --config configs/finetune_bbc.yaml --output-dir runs/bbc
    packed predict --model runs/bbc/model --input texts.jsonl --output predictions.jsonl
    packed embed --model FOLDER --input texts.jsonl --output vectors.npy
    packed serve --model runs/bbc/model --port 8080

A subcommand runs its job's own module as the main module, with the arguments after the
subcommand: the same options, checks (those answered before torch is imported included),
messages and exit codes as `python -m MODULE`, which keeps working. No job logic here.
"""

from __future__ import annotations

import runpy
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    """module: run as __main__ (its name inside packed_transformers); leading: arguments put before the user's (packing's own
    subcommand); summary: one line for `packed --help`."""

    module: str
    summary: str
    leading: tuple[str, ...] = ()


# The jobs, in the order a user meets them (README).
SUBCOMMANDS: dict[str, Subcommand] = {
    "pack": Subcommand(
        "packing", "unpacked shards -> static-shape packed shards (packing algorithms)", ("pack",)
    ),
    "verify": Subcommand("packing", "check a packed dataset holds every sequence exactly once", ("verify",)),
    "describe": Subcommand("packing", "packed datasets' lengths, packing factor and padding", ("describe",)),
    "unpack": Subcommand("packing", "packed shards -> the original unpacked rows", ("unpack",)),
    "plan": Subcommand("packing", "a packing plan's efficiency from a length histogram", ("plan",)),
    "pretrain": Subcommand("run_pretraining", "pretraining from a YAML config (BERT phase 2, MLPerf style)"),
    "train": Subcommand("finetune.train", "packed fine-tuning: classification, QA, decoders' SFT"),
    "predict": Subcommand(
        "commands.predict", "a fine-tuned or transformers folder's predictions, input order"
    ),
    "embed": Subcommand("commands.embed", "texts -> an .npy of embeddings (sentence-transformers' folders)"),
    "rerank": Subcommand(
        "commands.rerank", "a cross-encoder's scores and ranking of each query's texts, packed"
    ),
    "export": Subcommand(
        "commands.export", "a model folder -> a torch-free folder (ONNX Runtime graph, tokenizer)"
    ),
    "serve": Subcommand(
        "serving", "an HTTP server packing requests as they arrive (TEI's and OpenAI's APIs)"
    ),
    "gather": Subcommand(
        "ray_jobs.job", "a --ray job's Parquet shards -> the command's own output", ("gather",)
    ),
    "report": Subcommand("commands.report", "fine-tuning runs side by side"),
    "summary": Subcommand("training.summary", "pretraining runs compared, packed against unpacked"),
    "create-pretraining-data": Subcommand(
        "data.create_pretraining_data", "raw text -> unpacked pretraining shards (MLPerf's reference)"
    ),
    "train-vocab": Subcommand("data.train_vocab", "a WordPiece vocabulary learned from a corpus"),
    "train-tokenizer": Subcommand(
        "data.train_tokenizer", "a byte-level BPE tokenizer folder learned from JSON lines"
    ),
    "pack-documents": Subcommand(
        "commands.pack_documents", "raw text (C4's JSON lines) -> document-masked or concatenated LM rows"
    ),
    "pick-eval-samples": Subcommand("data.pick_eval_samples", "MLPerf's evaluation set picked from shards"),
    "convert-tf-checkpoint": Subcommand(
        "data.convert_tf_checkpoint", "a TF1 / NVIDIA BERT checkpoint -> a transformers folder"
    ),
    "qa-cloze": Subcommand("data.qa_cloze", "cloze questions in SQuAD's layout from BBC News"),
    "debian-texts": Subcommand("data.debian_texts", "Debian's package descriptions as JSON lines (LM text)"),
    "embedding-texts": Subcommand("data.embedding_texts", "texts of several length profiles to embed"),
    "mine-negatives": Subcommand(
        "commands.mine_negatives",
        "hard negatives for each (query, positive) pair, mined with an embedding model",
    ),
    "assets": Subcommand("data.assets", "where the offline assets are (the MiniLM model, the BBC corpus)"),
    "recipes": Subcommand(
        "commands.recipes", "the README's configs/ and examples/ written here (a pip install's)"
    ),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [
        "usage: packed SUBCOMMAND [options]   (packed SUBCOMMAND --help for its options)",
        "",
        "A sequence-packing toolkit for transformers: pretraining, fine-tuning, inference and",
        "serving of encoders and decoders on static-shape packs.",
        "",
        "subcommands:",
    ]
    lines += [f"  {name.ljust(width)}  {sub.summary}" for name, sub in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The subcommand's exit code; output cut off by a closed pipe (`packed ... --help | head`)
    ends quietly with 141 (128 + SIGPIPE, a shell's own code for it), never a traceback."""
    try:
        code = run(argv)
        sys.stdout.flush()  # inside the try: a pipe closed early fails here, not at exit
        return code
    except BrokenPipeError:
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 141


def run(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    sub = SUBCOMMANDS.get(name)
    if sub is None:
        import difflib

        near = difflib.get_close_matches(name, SUBCOMMANDS, n=1)
        hint = f"; did you mean '{near[0]}'?" if near else f"; one of {', '.join(SUBCOMMANDS)}"
        print(f"error: unknown subcommand {name!r}{hint}", file=sys.stderr)
        return 2
    from packed_transformers.common import cli

    # the job's --help and errors name it as the user called it (`packed gather`, not the module)
    cli.LAUNCHED_AS = "packed" if sub.leading else f"packed {name}"
    sys.argv = [f"packed {name}", *sub.leading, *rest]
    try:
        runpy.run_module(f"packed_transformers.{sub.module}", run_name="__main__", alter_sys=True)
    except SystemExit as done:  # the job's own exit code
        code = done.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except ModuleNotFoundError as err:  # a job the light install cannot run (it has no torch, transformers)
        from packed_transformers.common.preflight import missing_packages

        missing = missing_packages() if err.name in FULL_INSTALL_ONLY else None
        if missing is None:
            raise
        print(f"error: packed {name}: {missing}", file=sys.stderr)
        return 2
    return 0


# what the light install (requirements-runtime.txt) leaves out that a job may import
FULL_INSTALL_ONLY = ("torch", "transformers")


if __name__ == "__main__":
    sys.exit(main())
