"""Hard negatives for reranker (or embedding) training, mined with an embedding model on packs.

    packed mine-negatives --model EMBEDDER --input pairs.jsonl --output groups.jsonl
        [--negatives 5] [--range-min 0] [--range-max N] [--relative-margin 0.05] [--corpus texts.jsonl]

--input: JSON lines {"query": ..., "positive": ...} (--query-field, --positive-field; "anchor" for
the embedding recipe's pairs). The candidates are every positive of the file (and --corpus's
"text" lines), each text once. Each query and candidate is embedded once with the packed
`encode` (vectors equal to sentence-transformers' `encode`), and scored by cosine similarity.
A query's negatives are its nearest candidates that are none of its positives (every line with
the same query text counts), and, with --relative-margin m, none scoring above
positive - |positive| * m (its hardest positive's score): texts too near a positive to be sure
they are negatives. As sentence-transformers' `mine_hard_negatives` with sampling "top": the
range_max + (most positives a query has) nearest are looked at, the --range-min nearest
survivors skipped, the next --negatives kept, nearest first (tests/commands/test_mine_negatives.py
holds the two equal).

--output: one line per input line, in input order, {query field, positive field, "negative":
[texts, nearest first]}: what `packed train` with data.task rerank reads in its grouped form. A
line with fewer negatives than asked is kept with those it has and counted in the summary (never
dropped). The file appears whole by atomic rename; a one-line JSON summary goes to stdout.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # option and path mistakes answered before torch is imported
    from packed_transformers.commands.parsers import mine_negatives_parser
    from packed_transformers.common.preflight import exit_on_path_mistakes

    mine_negatives_parser(__doc__).parse_args()
    exit_on_path_mistakes({"--model": "folder", "--input": "json", "--corpus": "json"})

import json
import time
from dataclasses import dataclass

import numpy as np

from packed_transformers.commands.parsers import mine_negatives_parser
from packed_transformers.common.cli import below_one, refuse
from packed_transformers.common.files import atomic_path, describe_os_error, output_over_inputs
from packed_transformers.data.classification_data import ExampleError, bounded_lines, example_of_line


@dataclass(frozen=True)
class Pairs:
    """The input's lines in order: query and positive text of each."""

    queries: list[str]
    positives: list[str]


def read_pairs(path, query_field: str, positive_field: str) -> Pairs:
    """JSON lines with a query and a positive text each (data.text_rule); one line naming
    file:line and the field otherwise."""
    pairs = Pairs([], [])
    with open(path, "rb") as f:
        for number, raw in bounded_lines(f, str(path)):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            query, positive, _ = example_of_line(raw, where, query_field, positive_field, empty_ok=False)
            if not positive:
                raise ExampleError(
                    f"{where}: field '{positive_field}' is missing or empty (a positive text each line)"
                )
            pairs.queries.append(query)
            pairs.positives.append(positive)
    if not pairs.queries:
        raise ExampleError(f"{path}: no pairs (empty file)")
    return pairs


def read_corpus(path) -> list[str]:
    """--corpus: JSON lines {"text"}, each a candidate."""
    with open(path, "rb") as f:
        return [example_of_line(raw, f"{path}:{number}", "text", None, empty_ok=False)[0]
                for number, raw in bounded_lines(f, str(path)) if raw.strip()]  # fmt: skip


@dataclass(frozen=True)
class MiningRule:
    """Which candidates become a query's negatives (module docstring)."""

    negatives: int
    range_min: int = 0
    # None, as sentence-transformers derives it: range_min + negatives (10 x negatives with a margin,
    # which removes some) + the most positives a query has
    range_max: int | None = None
    relative_margin: float | None = None


def mine(query_vectors: np.ndarray, candidate_vectors: np.ndarray, positives_of: list[list[int]],
         rule: MiningRule) -> list[list[int]]:  # fmt: skip
    """Candidate indices of each query's negatives, nearest first.

    query_vectors float32 [q, D], candidate_vectors float32 [c, D] (any norm: cosine is taken);
    positives_of[i]: candidate indices of query i's positives."""
    q = query_vectors / np.linalg.norm(query_vectors, axis=1, keepdims=True)
    c = candidate_vectors / np.linalg.norm(candidate_vectors, axis=1, keepdims=True)
    scores = q @ c.T  # [q, c]
    most_positives = max(len(p) for p in positives_of)
    range_max = rule.range_max
    if range_max is None:
        wide = 10 if rule.relative_margin is not None else 1
        range_max = rule.range_min + wide * rule.negatives + most_positives
    looked_at = min(range_max + most_positives, scores.shape[1])
    found = []
    for i, row in enumerate(scores):
        nearest = np.argsort(-row, kind="stable")[:looked_at]
        own = set(positives_of[i])
        keep = [j for j in nearest if j not in own]
        if rule.relative_margin is not None:
            hardest = min(row[j] for j in own)
            keep = [j for j in keep if row[j] <= hardest - abs(hardest) * rule.relative_margin]
        found.append([int(j) for j in keep[:range_max][rule.range_min : rule.range_min + rule.negatives]])
    return found


def main(argv=None) -> int:
    args = mine_negatives_parser(__doc__).parse_args(argv)
    wrong = below_one(args, ("negatives", "batch_size")) or output_over_inputs(
        args.output, [args.input] + ([args.corpus] if args.corpus else []), [args.model]
    )
    if not wrong and args.range_min < 0:
        wrong = f"--range-min must be >= 0, got {args.range_min}"
    if not wrong and args.range_max is not None and args.range_max - args.range_min < args.negatives:
        wrong = (f"--range-max {args.range_max} leaves {args.range_max - args.range_min} candidates after --range-min "
                 f"{args.range_min}, fewer than --negatives {args.negatives}")  # fmt: skip
    if not wrong and args.relative_margin is not None and not 0 <= args.relative_margin < 1:
        wrong = f"--relative-margin must be in [0, 1), got {args.relative_margin}"
    if not wrong and args.output.exists() and not args.overwrite:
        wrong = f"--output {args.output}: exists; give --overwrite to replace it, or another path"
    if wrong:
        return refuse(wrong)
    from packed_transformers.door.opener import ForEmbedding, open_folder
    from packed_transformers.inference.embedding import encode
    from packed_transformers.inference.options import InferenceOptions
    from packed_transformers.model.hf_checkpoint import quiet_transformers

    quiet_transformers(args.verbose)
    try:
        pairs = read_pairs(args.input, args.query_field, args.positive_field)
        extra = read_corpus(args.corpus) if args.corpus else []
        # each text once, in first-seen order: the positives, then the corpus's own texts
        candidates = list(dict.fromkeys(pairs.positives + extra))
        place = {text: i for i, text in enumerate(candidates)}
        queries = list(dict.fromkeys(pairs.queries))
        query_place = {text: i for i, text in enumerate(queries)}
        positives_of: list[list[int]] = [[] for _ in queries]
        for query, positive in zip(pairs.queries, pairs.positives):
            if place[positive] not in positives_of[query_place[query]]:
                positives_of[query_place[query]].append(place[positive])
        encoder = open_folder(args.model, ForEmbedding(device=args.device))
        options = InferenceOptions.for_embedding(batch_size=args.batch_size, device=args.device)
        started = time.perf_counter()
        query_vectors = encode(queries, encoder, options)
        candidate_vectors = encode(candidates, encoder, options)
        embed_seconds = time.perf_counter() - started
        rule = MiningRule(args.negatives, args.range_min, args.range_max, args.relative_margin)
        negatives = mine(query_vectors, candidate_vectors, positives_of, rule)
        short = 0
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(args.output) as tmp, tmp.open("w", encoding="utf-8") as f:
            for query, positive in zip(pairs.queries, pairs.positives):
                mined = [candidates[j] for j in negatives[query_place[query]]]
                short += len(mined) < args.negatives
                record = {args.query_field: query, args.positive_field: positive, "negative": mined}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    except ExampleError as err:
        return refuse(err)
    except OSError as err:
        return refuse(describe_os_error(err))
    summary = {"lines": len(pairs.queries), "queries": len(queries), "candidates": len(candidates),
               "negatives_per_line": args.negatives, "lines_with_fewer_negatives": short,
               "embed_seconds": round(embed_seconds, 3), "output": str(args.output)}  # fmt: skip
    print(json.dumps(summary))
    if short:
        print(f"note: {short} of {len(pairs.queries)} lines have fewer than {args.negatives} negatives (kept with "
              "those found); widen --range-max or lower --relative-margin", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    from packed_transformers.common.cli import run_main

    sys.exit(run_main(main, "nothing was written (the output appears only when complete)"))
