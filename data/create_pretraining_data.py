"""`python -m data.create_pretraining_data`: raw text -> unpacked MLPerf-layout HDF5 shards.

The recipe of Google's BERT create_pretraining_data.py, which MLPerf's phase-2 data
uses: documents of sentences; each document is cut into chunks that fill a target length
(shorter with probability short_seq_prob); a chunk is split into segments A and B, and
with probability 0.5 (or when the chunk has one sentence) B is taken from a random other
document instead (NSP label 1); the pair is truncated to S - 3 tokens; then
round(masked_lm_prob x tokens) positions (at least 1, at most P) other than [CLS]/[SEP]
are masked: 80% [MASK], 10% the same token, 10% a random vocabulary token.

Input: text files, one document per file, blank-line or newline separated paragraphs.
UTF-8, falling back to cp1252 for legacy files (the file name is printed). Tokenization
is BERT WordPiece, uncased, with the `tokenizers` library.
"""

from __future__ import annotations

import argparse
import glob
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.files import write_json_atomic
from data.tokenizer import DataInputError, load_tokenizer
from data.unpacked_hdf5 import write_unpacked_shard

SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


@dataclass
class Instance:
    tokens: list[int]
    segment_ids: list[int]
    masked_lm_positions: list[int]
    masked_lm_ids: list[int]
    is_random_next: bool


def read_document(path: Path) -> tuple[str, bool]:
    """The text of one file, and whether it needed the cp1252 fallback."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace"), True


def split_sentences(text: str) -> list[str]:
    sentences = []
    for paragraph in text.splitlines():
        paragraph = paragraph.strip()
        if paragraph:
            sentences.extend(s.strip() for s in SENTENCE_END.split(paragraph) if s.strip())
    return sentences


def tokenize_documents(files: list[Path], tokenizer) -> list[list[list[int]]]:
    documents = []
    for path in files:
        text, legacy = read_document(path)
        if legacy:
            print(f"note: {path} is not UTF-8; read as cp1252", file=sys.stderr)
        sentences = split_sentences(text)
        if not sentences:
            continue
        encoded = tokenizer.encode_batch(sentences, add_special_tokens=False)
        document = [e.ids for e in encoded if e.ids]
        if document:
            documents.append(document)
    return documents


def truncate_seq_pair(tokens_a: list, tokens_b: list, max_tokens: int, rng: random.Random) -> None:
    while len(tokens_a) + len(tokens_b) > max_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def mask_tokens(tokens, special, vocab_size, mask_id, masked_lm_prob, max_predictions, rng):
    """-> (masked tokens, positions sorted ascending, original ids at those positions)."""
    candidates = [i for i, t in enumerate(tokens) if i not in special]
    rng.shuffle(candidates)
    count = min(max_predictions, max(1, int(round(len(tokens) * masked_lm_prob))))
    output = list(tokens)
    chosen = sorted(candidates[:count])
    for position in chosen:
        draw = rng.random()
        if draw < 0.8:
            output[position] = mask_id
        elif draw < 0.9:
            pass  # keep the original token
        else:
            output[position] = rng.randint(0, vocab_size - 1)
    return output, chosen, [tokens[p] for p in chosen]


def instances_from_document(documents, index, args, ids, vocab_size, rng) -> list[Instance]:
    """Google's create_instances_from_document, token ids instead of strings."""
    document = documents[index]
    max_tokens = args.max_seq_length - 3
    target = max_tokens
    if rng.random() < args.short_seq_prob:
        target = rng.randint(2, max_tokens)
    instances, chunk, chunk_length, i = [], [], 0, 0
    while i < len(document):
        chunk.append(document[i])
        chunk_length += len(document[i])
        if i == len(document) - 1 or chunk_length >= target:
            if chunk:
                a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                tokens_a = [t for sentence in chunk[:a_end] for t in sentence]
                tokens_b: list[int] = []
                random_next = len(documents) > 1 and (len(chunk) == 1 or rng.random() < 0.5)
                if random_next:
                    target_b = target - len(tokens_a)
                    for _ in range(10):
                        other = rng.randint(0, len(documents) - 1)
                        if other != index:
                            break
                    other_doc = documents[other]
                    for sentence in other_doc[rng.randint(0, len(other_doc) - 1) :]:
                        tokens_b.extend(sentence)
                        if len(tokens_b) >= target_b:
                            break
                    i -= len(chunk) - a_end  # the unused sentences start the next chunk
                else:
                    tokens_b = [t for sentence in chunk[a_end:] for t in sentence]
                truncate_seq_pair(tokens_a, tokens_b, max_tokens, rng)
                if tokens_a and tokens_b:
                    tokens = [ids["[CLS]"], *tokens_a, ids["[SEP]"], *tokens_b, ids["[SEP]"]]
                    segments = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
                    special = {0, len(tokens_a) + 1, len(tokens) - 1}
                    masked, positions, labels = mask_tokens(
                        tokens,
                        special,
                        vocab_size,
                        ids["[MASK]"],
                        args.masked_lm_prob,
                        args.max_predictions_per_seq,
                        rng,
                    )
                    instances.append(Instance(masked, segments, positions, labels, random_next))
            chunk, chunk_length = [], 0
        i += 1
    return instances


def to_arrays(instances: list[Instance], s: int, p: int) -> dict:
    n = len(instances)
    out = {
        "input_ids": np.zeros((n, s), np.int64),
        "input_mask": np.zeros((n, s), np.int64),
        "segment_ids": np.zeros((n, s), np.int64),
        "masked_lm_positions": np.zeros((n, p), np.int64),
        "masked_lm_ids": np.zeros((n, p), np.int64),
        "next_sentence_labels": np.zeros(n, np.int64),
    }
    for row, inst in enumerate(instances):
        length, count = len(inst.tokens), len(inst.masked_lm_positions)
        out["input_ids"][row, :length] = inst.tokens
        out["input_mask"][row, :length] = 1
        out["segment_ids"][row, :length] = inst.segment_ids
        out["masked_lm_positions"][row, :count] = inst.masked_lm_positions
        out["masked_lm_ids"][row, :count] = inst.masked_lm_ids
        out["next_sentence_labels"][row] = int(inst.is_random_next)
    return out


def write_shards(instances, folder: Path, s: int, p: int, rows_per_shard: int, vocab_size: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for index, start in enumerate(range(0, len(instances), rows_per_shard)):
        name = f"part-{index:05d}.h5"
        arrays = to_arrays(instances[start : start + rows_per_shard], s, p)
        write_unpacked_shard(folder / name, arrays, vocab_size)
        names.append(name)
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.create_pretraining_data", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--input", nargs="+", required=True, metavar="FILE", help="text files or globs, one document each"
    )
    p.add_argument("--vocab", required=True, type=Path, help="BERT vocab.txt (uncased WordPiece)")
    p.add_argument("--output", required=True, type=Path, metavar="DIR")
    p.add_argument("--max-seq-length", type=int, default=512)
    p.add_argument("--max-predictions-per-seq", type=int, default=76)
    p.add_argument("--masked-lm-prob", type=float, default=0.15)
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--dupe-factor", type=int, default=10, help="passes over the documents, each masked anew")
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--rows-per-shard", type=int, default=1 << 16)
    p.add_argument(
        "--eval-documents",
        type=int,
        default=0,
        help="hold out this many documents (dupe factor 1) as an evaluation set in DIR/eval/",
    )
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
    if args.dupe_factor < 1 or args.rows_per_shard < 1 or args.eval_documents < 0:
        raise DataInputError("--dupe-factor and --rows-per-shard must be >= 1, --eval-documents >= 0")


def expand(patterns: list[str]) -> list[Path]:
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            raise DataInputError(f"--input {pattern!r} matches no file")
        files.extend(Path(m) for m in matches)
    return files


def create(args) -> dict:
    validate_args(args)
    files = expand(args.input)
    if args.output.is_dir() and any(args.output.glob("part-*.h5")):
        raise DataInputError(
            f"--output {args.output} already holds part-*.h5 shards; choose an empty directory"
        )
    tokenizer, vocab = load_tokenizer(args.vocab)
    vocab_size = max(vocab.values()) + 1
    rng = random.Random(args.seed)
    documents = tokenize_documents(files, tokenizer)
    rng.shuffle(documents)
    if not documents:
        raise DataInputError(f"--input: the {len(files)} file(s) hold no text (every document is empty)")
    if args.eval_documents >= len(documents):
        raise DataInputError(
            f"--eval-documents {args.eval_documents} leaves no training document ({len(documents)} in the input)"
        )
    held_out = documents[len(documents) - args.eval_documents :] if args.eval_documents else []
    documents = documents[: len(documents) - len(held_out)]
    instances = []
    for _ in range(args.dupe_factor):
        for index in range(len(documents)):
            instances.extend(instances_from_document(documents, index, args, vocab, vocab_size, rng))
    rng.shuffle(instances)
    summary = {
        "documents": len(documents),
        "files": len(files),
        "sequences": len(instances),
        "shards": write_shards(
            instances,
            args.output,
            args.max_seq_length,
            args.max_predictions_per_seq,
            args.rows_per_shard,
            vocab_size,
        ),
    }
    if held_out:
        eval_instances = []
        for index in range(len(held_out)):
            eval_instances.extend(instances_from_document(held_out, index, args, vocab, vocab_size, rng))
        write_shards(
            eval_instances,
            args.output / "eval",
            args.max_seq_length,
            args.max_predictions_per_seq,
            args.rows_per_shard,
            vocab_size,
        )
        summary.update(eval_documents=len(held_out), eval_sequences=len(eval_instances))
    summary.update(
        vocab_size=vocab_size,
        options={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    )
    write_json_atomic(args.output / "creation.json", summary)
    return summary


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = create(args)
    except DataInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in summary.items() if k not in ("options", "shards")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
