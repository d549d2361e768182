"""`python -m packed_transformers.data.create_pretraining_data`: raw text -> unpacked MLPerf-layout HDF5 shards,
equal to the MLPerf reference generator (mlcommons/training `create_pretraining_data.py`,
google-research/bert's without whole-word masking): the same instances in the same order for
the same seed, byte for byte in all six fields.

The recipe: documents of sentences; each document is cut into chunks that fill a target length
(shorter with probability short_seq_prob); a chunk is split into segments A and B, and with
probability 0.5 (or when the chunk has one sentence) B is taken from a random other document
instead (NSP label 1); the pair is truncated to S - 3 tokens; then round(masked_lm_prob x tokens)
positions (at least 1, at most P) other than [CLS]/[SEP] are masked: 80% [MASK], 10% the same
token, 10% a random vocabulary token. The random draws are listed in data/pretraining_instances.py.

Input formats (`--input-format`):
- `lines` (the reference's, and MLPerf's Wikipedia `part-000xx-of-00500` files): one sentence
  per line, a blank line between documents. As in the reference, files are read in order as one
  stream: a document runs on into the next file unless a blank line ends it.
- `one-document-per-file`: each file is a document of paragraphs; sentences are found by a
  punctuation rule. Not the reference's; for corpora such as BBC News.

Files are UTF-8; a file that is not falls back to cp1252 (the file is named on stderr).
`--per-part` runs each input file on its own with the same seed, one output shard per input,
as MLPerf prepares its 500 Wikipedia parts, over `--workers` processes.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from packed_transformers.common.cli import command_parser, refuse
from packed_transformers.common.files import write_json_atomic
from packed_transformers.data.pretraining_instances import Recipe, SpecialIds, create_instances
from packed_transformers.data.reference_tokenizer import ReferenceTokenizer, read_vocab
from packed_transformers.data.tokenizer import DataInputError
from packed_transformers.packs.unpacked_hdf5 import write_unpacked_shard

INPUT_FORMATS = ("lines", "one-document-per-file")
SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def read_document(path: Path) -> tuple[str, bool]:
    """The text of one file, and whether it needed the cp1252 fallback."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace"), True


def split_sentences(text: str) -> list[str]:
    """Sentences of a plain-text document: paragraphs are lines, sentences end at . ! ? before
    a capital or digit (the `one-document-per-file` format and the classification data)."""
    sentences = []
    for paragraph in text.splitlines():
        paragraph = paragraph.strip()
        if paragraph:
            sentences.extend(s.strip() for s in SENTENCE_END.split(paragraph) if s.strip())
    return sentences


def _read_text(path: Path) -> str:
    text, legacy = read_document(path)
    if legacy:
        print(f"note: {path} is not UTF-8; read as cp1252", file=sys.stderr)
    return text


def read_line_documents(files: list[Path], tokenizer: ReferenceTokenizer) -> list[list[list[int]]]:
    """The reference's format: a sentence per line, blank lines between documents. Lines are
    split at "\\n" only (not at U+2028 and friends) and stripped, as the reference reads them;
    a line with no token (control characters only) is skipped without ending the document."""
    documents: list[list[list[int]]] = [[]]
    for path in files:
        lines = _read_text(path).split("\n")
        if lines[-1] == "":
            lines.pop()  # the file's final newline ends its last line; it is not a blank line
        lines = [line.strip() for line in lines]
        for line, ids in zip(lines, tokenizer.encode_lines(lines)):
            if not line:
                documents.append([])
            elif ids:
                documents[-1].append(ids)
    return [document for document in documents if document]


def read_file_documents(files: list[Path], tokenizer: ReferenceTokenizer) -> list[list[list[int]]]:
    """One document per file, sentences by `split_sentences`."""
    documents = []
    for path in files:
        sentences = split_sentences(_read_text(path))
        document = [ids for ids in tokenizer.encode_lines(sentences) if ids]
        if document:
            documents.append(document)
    return documents


READERS = {"lines": read_line_documents, "one-document-per-file": read_file_documents}


@dataclass(frozen=True)
class Job:
    """One generator run: input files -> shards in `output`. Picklable (a worker task)."""

    files: tuple[Path, ...]
    output: Path
    shard_names: tuple[str, ...] | None  # one name per shard (per-part mode); None: part-NNNNN.h5
    input_format: str
    vocab_file: Path
    recipe: Recipe
    dupe_factor: int
    seed: int
    rows_per_shard: int
    eval_documents: int = 0


def run_job(job: Job) -> dict:
    """Read, tokenize, create and write. -> a summary (counts and shard names)."""
    vocab = read_vocab(job.vocab_file)
    tokenizer = ReferenceTokenizer(vocab)
    ids = SpecialIds.from_vocab(vocab)
    rng = random.Random(job.seed)
    documents = READERS[job.input_format](list(job.files), tokenizer)
    if not documents:
        names = ", ".join(map(str, job.files[:3]))
        raise DataInputError(f"--input {names}: no text (every document is empty)")
    rng.shuffle(documents)
    if job.eval_documents >= len(documents):
        raise DataInputError(
            f"--eval-documents {job.eval_documents} leaves no training document ({len(documents)} in the input)"
        )
    held_out = documents[len(documents) - job.eval_documents :] if job.eval_documents else []
    documents = documents[: len(documents) - len(held_out)]
    store, order = create_instances(documents, job.dupe_factor, job.recipe, ids, rng)
    summary = {
        "documents": len(documents),
        "sentences": sum(map(len, documents)),
        "sequences": len(order),
        "random_next": sum(store.random_next),
        "shards": write_shards(store, order, job, len(vocab)),
    }
    if held_out:
        # Not in the reference: our evaluation hold-out, drawn after the training instances.
        eval_store, eval_order = create_instances(held_out, 1, job.recipe, ids, rng)
        eval_job = Job(**{**job.__dict__, "output": job.output / "eval", "shard_names": None})
        write_shards(eval_store, eval_order, eval_job, len(vocab))
        summary.update(eval_documents=len(held_out), eval_sequences=len(eval_order))
    return summary


def write_shards(store, order: list[int], job: Job, vocab_size: int) -> list[str]:
    """Rows in `order`, `rows_per_shard` to a shard (one shard per name in per-part mode)."""
    job.output.mkdir(parents=True, exist_ok=True)
    s, p = job.recipe.max_seq_length, job.recipe.max_predictions_per_seq
    if job.shard_names is not None:
        chunks = [(job.shard_names[0], order)]
    else:
        starts = range(0, len(order), job.rows_per_shard)
        chunks = [
            (f"part-{i:05d}.h5", order[start : start + job.rows_per_shard]) for i, start in enumerate(starts)
        ]
    for name, rows in chunks:
        write_unpacked_shard(job.output / name, store.arrays(rows, s, p), vocab_size)
    return [name for name, _ in chunks]


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("python -m packed_transformers.data.create_pretraining_data", __doc__)
    p.add_argument("--input", nargs="+", required=True, metavar="FILE", help="text files or globs")
    p.add_argument(
        "--input-format",
        choices=INPUT_FORMATS,
        default="lines",
        help="lines: a sentence per line, a blank line between documents (a file without a final blank "
        "line runs its last document on into the next file, as MLPerf's reference does); "
        "one-document-per-file: each file is one document",
    )
    p.add_argument("--vocab", required=True, type=Path, help="BERT vocab.txt (uncased WordPiece)")
    p.add_argument("--output", required=True, type=Path, metavar="DIR")
    p.add_argument("--max-seq-length", type=int, default=512, help="S, tokens per sequence")
    p.add_argument("--max-predictions-per-seq", type=int, default=76, help="P, masked-LM slots per sequence")
    p.add_argument("--masked-lm-prob", type=float, default=0.15, help="share of tokens masked")
    p.add_argument(
        "--short-seq-prob", type=float, default=0.1, help="chance of a shorter random target length"
    )
    p.add_argument("--dupe-factor", type=int, default=10, help="passes over the documents, each masked anew")
    p.add_argument(
        "--seed", type=int, default=12345, help="seed of every random draw (the reference's order)"
    )
    p.add_argument("--rows-per-shard", type=int, default=1 << 16, help="sequences per output shard")
    p.add_argument(
        "--eval-documents",
        type=int,
        default=0,
        help="hold out this many documents (dupe factor 1) as an evaluation set in DIR/eval/ (not in per-part mode)",
    )
    p.add_argument(
        "--per-part",
        action="store_true",
        help="each input file on its own (same seed), one shard per input named after it: MLPerf's 500 parts",
    )
    p.add_argument("--workers", type=int, default=1, help="processes for --per-part")
    p.add_argument("--skip-existing", action="store_true", help="--per-part: keep shards already in DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def validate_args(args) -> None:
    if args.max_seq_length < 8:
        raise DataInputError(f"--max-seq-length must be >= 8, got {args.max_seq_length}")
    if args.max_predictions_per_seq < 1:
        raise DataInputError(f"--max-predictions-per-seq must be >= 1, got {args.max_predictions_per_seq}")
    for name in ("masked_lm_prob", "short_seq_prob"):
        value = getattr(args, name)
        if not 0.0 <= value <= 1.0:
            raise DataInputError(f"--{name.replace('_', '-')} must be in [0, 1], got {value}")
    if args.dupe_factor < 1 or args.rows_per_shard < 1 or args.eval_documents < 0 or args.workers < 1:
        raise DataInputError(
            "--dupe-factor, --rows-per-shard and --workers must be >= 1, --eval-documents >= 0"
        )
    if args.per_part and args.eval_documents:
        raise DataInputError(
            "--eval-documents does not apply with --per-part (MLPerf's eval text is its own input)"
        )
    if args.skip_existing and not args.per_part:
        raise DataInputError("--skip-existing applies only with --per-part")


def expand(patterns: list[str]) -> list[Path]:
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            raise DataInputError(f"--input {pattern!r} matches no file")
        files.extend(Path(m) for m in matches)
    return files


def _part_name(path: Path) -> str:
    return f"{path.name}.h5"


def create(args) -> dict:
    validate_args(args)
    files = expand(args.input)
    vocab_size = len(read_vocab(args.vocab))  # a bad vocabulary is reported before any work
    recipe = Recipe(
        args.max_seq_length, args.max_predictions_per_seq, args.masked_lm_prob, args.short_seq_prob
    )
    common = dict(
        input_format=args.input_format,
        vocab_file=args.vocab,
        recipe=recipe,
        dupe_factor=args.dupe_factor,
        seed=args.seed,
        rows_per_shard=args.rows_per_shard,
    )
    existing = sorted(args.output.glob("*.h5")) if args.output.is_dir() else []
    if existing and not args.skip_existing:
        raise DataInputError(
            f"--output {args.output} already holds {existing[0].name}; choose an empty directory"
        )
    started = time.perf_counter()
    if args.per_part:
        summary = create_parts(files, args, common)
    else:
        summary = run_job(
            Job(
                files=tuple(files),
                output=args.output,
                shard_names=None,
                eval_documents=args.eval_documents,
                **common,
            )
        )
        summary["files"] = len(files)
    seconds = time.perf_counter() - started
    summary.update(
        seconds=round(seconds, 2),
        sequences_per_second=round(summary["sequences"] / max(seconds, 1e-9), 1),
        vocab_size=vocab_size,
        options={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    )
    write_json_atomic(args.output / "creation.json", summary)
    return summary


def create_parts(files: list[Path], args, common: dict) -> dict:
    """--per-part: one job per input file over a worker pool, progress in sequences/s."""
    from tqdm import tqdm

    from packed_transformers.packs.workers import run_tasks

    names = [_part_name(f) for f in files]
    if len(set(names)) != len(names):
        raise DataInputError("--per-part: two inputs have the same file name; their shards would collide")
    todo = [
        Job(files=(f,), output=args.output, shard_names=(name,), **common)
        for f, name in zip(files, names)
        if not (args.skip_existing and (args.output / name).exists())
    ]
    if args.workers > 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers are the parallelism
    totals = {"sequences": 0}
    progress = tqdm(
        total=len(files), initial=len(files) - len(todo), unit="part", disable=args.quiet, smoothing=0
    )
    started = time.perf_counter()

    def advance(_job, result):
        totals["sequences"] += result["sequences"]
        progress.set_postfix_str(f"{totals['sequences'] / (time.perf_counter() - started):,.0f} seq/s")
        return 1

    with progress:
        results = run_tasks(run_job, todo, args.workers, [], progress, weight=advance)
    return {
        "files": len(files),
        "parts_created": len(todo),
        "parts_kept": len(files) - len(todo),
        "documents": sum(r["documents"] for r in results),
        "sentences": sum(r["sentences"] for r in results),
        "sequences": sum(r["sequences"] for r in results),
        "random_next": sum(r["random_next"] for r in results),
        "shards": names,
    }


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = create(args)
    except DataInputError as err:
        return refuse(err)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("options", "shards")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
