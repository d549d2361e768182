"""`packed pack-documents`: raw text (C4's JSON lines) -> causal-LM rows for decoder pretraining.

    packed pack-documents --input c4-train.*.json --tokenizer TOKENIZER_DIR --output work/lm \\
        [--max-sequence-length 8192] [--layout documents|concatenated|both] [--eval-rows 1024]

Each document is tokenized as the tokenizer folder's transformers tokenizer does it, EOS
appended. Held-out documents (a seeded draw) become exactly --eval-rows evaluation rows; the
rest are the training rows. Layouts (packs.lm_rows.layouts): `documents` packs whole documents
with document masking (longer ones split every S tokens, said in the report); `concatenated`
is MLPerf's reference (back to back, cut every S tokens). Written, each by atomic rename:

    OUTPUT/<layout>/train/, OUTPUT/<layout>/eval/   (packs.lm_rows.store's format)
    OUTPUT/report.json                              documents, tokens, real-token share, K,
                                                    splits, left-out tail, crossing share

Every document is checked present exactly once (token for token) before anything is written.
Bad input: one line naming the file, line or option, exit 2, nothing written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from packed_transformers.common.cli import command_parser, refuse, run_main
from packed_transformers.common.files import output_folder_mistake


def parse_args(argv=None) -> argparse.Namespace:
    parser = command_parser("packed pack-documents", __doc__)
    parser.add_argument("--input", nargs="+", required=True, help="JSON-lines files, one document per line")
    parser.add_argument("--tokenizer", required=True, help="a tokenizer (or model) folder transformers reads")
    parser.add_argument("--output", required=True, help="output folder")
    parser.add_argument("--max-sequence-length", type=int, default=8192, help="S: tokens per row (8192)")
    parser.add_argument("--layout", choices=("documents", "concatenated", "both"), default="both")
    parser.add_argument("--eval-rows", type=int, default=1024, help="held-out rows (MLPerf: 1024); 0: none")
    parser.add_argument(
        "--max-sequences-per-pack",
        type=int,
        help="K of the documents layout (default: from the lengths, >= 16)",
    )
    parser.add_argument("--algorithm", default="lpfhp", help="packing algorithm (packs.algorithms)")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--seed", type=int, default=0, help="held-out draw and row order")
    return parser.parse_args(argv)


def held_out(lengths, rows: int, length: int, seed: int):
    """(evaluation documents, training documents): a seeded draw of documents whose tokens
    fill `rows` rows with a margin of one row in 8 (the documents layout keeps its fullest
    `rows` rows and returns the rest's documents to training)."""
    import numpy as np

    lengths = np.asarray(lengths)
    order = np.random.default_rng(seed).permutation(len(lengths))
    if rows == 0:
        return order[:0], np.sort(order)
    # Only documents of at most S tokens are held out: each then lies in one row, and a row
    # left over returns its documents to training whole.
    fits = order[lengths[order] <= length]
    need = rows * length * (1 + 1 / 8)
    taken = int(np.searchsorted(np.cumsum(lengths[fits]), need)) + 1
    if taken >= len(fits):
        raise ValueError(
            f"--eval-rows {rows}: {rows} rows of {length} tokens need about {int(need)} held-out tokens (from "
            f"documents of at most {length}) and leave some to train on; the input has {int(lengths.sum())} in all "
            f"(give more text, or fewer --eval-rows)"
        )
    held = np.sort(fits[:taken])
    return held, np.setdiff1d(np.arange(len(lengths)), held)


def build_layout(layout: str, tokens, eval_docs, train_docs, args):
    """(train Rows, eval Rows or None, train document indices) of one layout."""
    from packed_transformers.packs.lm_rows.layouts import concatenated_rows, document_rows

    length, depth = args.max_sequence_length, args.max_sequences_per_pack

    def rows_of(indices):
        picked = [tokens[i] for i in indices]
        if layout == "concatenated":
            return concatenated_rows(picked, length)
        return document_rows(picked, length, depth, args.algorithm, args.seed)

    evaluation = None
    if len(eval_docs):
        evaluation = rows_of(eval_docs)
        if evaluation.input_ids.shape[0] < args.eval_rows:
            raise ValueError(
                f"--eval-rows {args.eval_rows}: the held-out documents filled only {evaluation.input_ids.shape[0]} rows"
            )
        evaluation, returned = keep_rows(evaluation, args.eval_rows, eval_docs, [len(t) for t in tokens])
        train_docs = sorted([*train_docs, *returned])
    return rows_of(train_docs), evaluation, train_docs


def keep_rows(rows, count: int, documents, lengths):
    """The first `count` rows (concatenated: the stream's first rows, as the reference cuts;
    documents: the `count` fullest) and the documents with no token in them, which go back to
    training whole. documents: the rows' document indices -> the input's; lengths: the input's
    document lengths. In the concatenated layout the one document cut at the last kept row
    keeps its head in evaluation and its tail out (Rows.left_out_tokens)."""
    import numpy as np

    from packed_transformers.packs.lm_rows.layouts import Rows

    if rows.layout == "concatenated":
        order = np.arange(count)
    else:
        order = np.sort(np.argsort(-(rows.sequence_ids > 0).sum(1), kind="stable")[:count])
    kept = {name: value[order] for name, value in rows.fields().items()}
    ids = kept["document_ids"]
    inside = np.unique(ids[ids >= 0])
    returned = np.setdiff1d(np.arange(len(documents)), inside)
    left_out = int(np.asarray(lengths)[np.asarray(documents)[inside]].sum()) - int((ids >= 0).sum())
    kept_rows = Rows(**kept, layout=rows.layout, depth=rows.depth, split_documents=rows.split_documents,
                     left_out_tokens=left_out)  # fmt: skip
    return kept_rows, [int(documents[i]) for i in returned]


def repeated_input(inputs: list[Path]) -> str | None:
    """One line where two --input paths name one file (the same path twice, a link, another
    spelling): its documents would be packed twice (each datum exactly once)."""
    import os

    seen = {}
    for path in inputs:
        try:
            stat = os.stat(path)
        except OSError:
            continue  # a missing file is the reader's to name
        key = (stat.st_dev, stat.st_ino)
        if key in seen:
            return (
                f"--input {path} is the same file as --input {seen[key]}: its documents would be packed twice"
            )
        seen[key] = path
    return None


def globalize(rows, documents) -> None:
    """Rows' document ids (indices into the documents they were built from) -> the input's
    document numbers `documents[id]`, in place."""
    import numpy as np

    real = rows.document_ids >= 0
    rows.document_ids = np.where(real, documents[np.where(real, rows.document_ids, 0)], -1).astype(np.int32)


def main(argv=None) -> int:
    args = parse_args(argv)
    inputs = [Path(p) for p in args.input]
    mistake = repeated_input(inputs) or output_folder_mistake(
        Path(args.output), [*inputs, Path(args.tokenizer)], "report.json"
    )
    if mistake:
        return refuse(mistake)
    from packed_transformers.common.input_limits import MAX_SEQUENCE_LENGTH

    if not 2 <= args.max_sequence_length <= MAX_SEQUENCE_LENGTH:
        return refuse(
            f"--max-sequence-length {args.max_sequence_length}: expected 2 to {MAX_SEQUENCE_LENGTH:,} tokens"
        )
    if args.eval_rows < 0:
        return refuse(f"--eval-rows {args.eval_rows}: expected 0 or more")
    from packed_transformers.data.classification_data import ExampleError
    from packed_transformers.data.documents import read_documents, tokenize_documents
    from packed_transformers.door.folder import open_tokenizer
    from packed_transformers.packs.algorithms import ALGORITHMS

    if args.algorithm not in ALGORITHMS:
        return refuse(f"--algorithm {args.algorithm}: one of {', '.join(ALGORITHMS)}")
    try:
        texts = read_documents(inputs, args.text_field)
        tokenizer = open_tokenizer(Path(args.tokenizer))
    except ExampleError as err:
        return refuse(str(err))
    if tokenizer.eos_id is None:
        return refuse(
            f"--tokenizer {args.tokenizer}: names no end-of-sequence token (eos_token in tokenizer_config.json)"
        )
    tokens = tokenize_documents(texts.texts, tokenizer.tokenizer, tokenizer.eos_id)
    try:
        return write_all(args, texts, tokens, tokenizer)
    except OSError as err:  # a full disk, a file-size limit, a read-only folder: nothing is left behind
        # named by the output the user gave (the failing path is inside its temporary folder)
        return refuse(f"--output {args.output}: {err.strerror or err}; nothing was written")


def write_all(args, texts, tokens, tokenizer) -> int:
    import numpy as np

    from packed_transformers.common.files import atomic_folder
    from packed_transformers.packs.errors import PackingInputError
    from packed_transformers.packs.lm_rows.layouts import check_rows, crossing_share
    from packed_transformers.packs.lm_rows.store import write_rows

    lengths = np.array([len(t) for t in tokens])
    vocab_size = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    try:
        eval_docs, train_docs = held_out(lengths, args.eval_rows, args.max_sequence_length, args.seed)
    except ValueError as err:
        return refuse(str(err))
    layouts = ("documents", "concatenated") if args.layout == "both" else (args.layout,)
    built = {}
    for layout in layouts:
        try:
            train, evaluation, train_ids = build_layout(layout, tokens, eval_docs, train_docs, args)
        except (ValueError, PackingInputError) as err:
            return refuse(f"{layout} layout: {err}")
        check_rows(train, [tokens[i] for i in train_ids])  # every training document exactly once
        if evaluation is not None:
            kept = np.isin(eval_docs, train_ids, invert=True)  # the others went back to training
            check_rows(evaluation, [tokens[i] for i in eval_docs], present=kept)
        # document_ids from here on: the input's document numbers (its non-blank lines, 0-based)
        globalize(train, np.asarray(train_ids))
        if evaluation is not None:
            globalize(evaluation, np.asarray(eval_docs))
        built[layout] = (train, evaluation, train_ids)
    report = {"input": [str(p) for p in args.input], "documents": len(tokens), "blank_lines_left_out": len(texts.blank),
              "tokenizer": str(args.tokenizer), "S": args.max_sequence_length, "layouts": {}}  # fmt: skip
    with atomic_folder(Path(args.output)) as tmp:
        for layout, (train, evaluation, train_ids) in built.items():
            for role, rows in (("train", train), ("eval", evaluation)):
                if rows is None:
                    continue
                about = {"role": role, "tokenizer": str(args.tokenizer), "documents_in": len(tokens)}
                write_rows(tmp / layout / role, rows, vocab_size, tokenizer.eos_id, about)
            report["layouts"][layout] = {
                role: {
                    "rows": int(rows.input_ids.shape[0]),
                    "real_tokens": rows.real_tokens,
                    "real_token_share": round(rows.real_tokens / rows.input_ids.size, 6),
                    "K": rows.depth,
                    "documents_split": rows.split_documents,
                    "tokens_left_out": rows.left_out_tokens,
                    "crossing_attention_pair_share": round(crossing_share(rows), 6),
                }
                for role, rows in (("train", train), ("eval", evaluation))
                if rows is not None
            } | {"train_documents": len(train_ids)}
        (tmp / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["layouts"]))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "no packed rows were written (they appear only when complete)"))
