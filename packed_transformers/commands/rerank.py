"""packed rerank: a cross-encoder scores each query's candidate texts, every pair of the file packed.

    packed rerank --model FOLDER --input queries.jsonl --output scores.jsonl [--raw-scores]

--model: a one-label sequence-classification folder (a cross-encoder reranker: a folder
sentence-transformers' `CrossEncoder` loads, one `packed train` wrote, or one `packed export`
wrote from it). --input: JSON lines, one query each, in TEI's /rerank request's names:
`{"query": "...", "texts": ["candidate", ...]}`. Each (query, text) is one example, the query
first and the candidate as its pair, as `CrossEncoder.predict([(query, text), ...])` feeds
them ([CLS] query [SEP] text [SEP] for BERT); the pairs of every query are packed together, so a
short query joined to candidates of mixed length costs its tokens, not a padded batch's.

--output: line i for input line i, `{"index": i, "scores": [one per text, input order],
"ranking": [text indices, best first]}`; a score is the sigmoid of the model's logit (what
`CrossEncoder.predict` returns for one label, and TEI's /rerank without raw_scores), the logit
itself with --raw-scores. The file appears whole (atomic rename); an existing one is replaced
only with --overwrite. A one-line JSON summary goes to stdout. The server's /rerank scores the
same way (serving/engines.py); tests/commands/test_rerank.py holds both equal to
sentence-transformers' CrossEncoder.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from packed_transformers.common.cli import add_inference_options, command_parser, refuse
from packed_transformers.common.files import atomic_path, describe_os_error, output_over_inputs
from packed_transformers.data.classification_data import (
    ExampleError,
    Examples,
    bounded_lines,
    check_readable,
    record_of_line,
)

# a query's candidates: TEI's /rerank takes a list; one line holds at most this many
MAX_TEXTS_PER_QUERY = 10_000


def rerank_parser(doc: str):
    from packed_transformers.commands.parsers import add_runtime_option

    parser = command_parser("python -m packed_transformers.commands.rerank", doc)
    add_inference_options(parser, "a one-label sequence-classification folder (a cross-encoder reranker)")
    parser.add_argument("--input", required=True, type=Path, help='JSON lines {"query": ..., "texts": [...]}')
    parser.add_argument("--output", required=True, type=Path, help="scores and ranking per query, JSON lines")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    parser.add_argument("--batch-size", type=int, default=64, help="pairs per batch")
    parser.add_argument("--raw-scores", action="store_true", help="the logits, not their sigmoid")
    add_runtime_option(parser)
    return parser


def read_queries(path: Path) -> list[tuple[str, list[str]]]:
    """[(query, [text, ...])] of a JSON-lines file, in order; ExampleError naming file:line and
    the field for anything else (blank lines skipped)."""
    from packed_transformers.data.text_rule import check_text

    check_readable(path)
    queries = []
    with path.open("rb") as f:
        for number, raw in bounded_lines(f, str(path)):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            record = record_of_line(raw, where)
            for name in ("query", "texts"):
                if name not in record:
                    raise ExampleError(
                        f'{where}: field \'{name}\' is missing; expected {{"query": ..., "texts": [...]}}'
                    )
            query = check_text(record["query"], f"{where}: field 'query'", empty_ok=False)
            texts = record["texts"]
            if not isinstance(texts, list) or not 0 < len(texts) <= MAX_TEXTS_PER_QUERY:
                raise ExampleError(
                    f"{where}: field 'texts' must be a list of 1 to {MAX_TEXTS_PER_QUERY:,} texts"
                )
            queries.append(
                (
                    query,
                    [
                        check_text(t, f"{where}: field 'texts'[{j}]", empty_ok=False)
                        for j, t in enumerate(texts)
                    ],
                )
            )
    if not queries:
        raise ExampleError(f"{path}: no queries (one JSON object a line)")
    return queries


def pairs_of(queries: list[tuple[str, list[str]]], path: Path) -> Examples:
    """Every (query, text) pair of the file as one example: the query the text, the candidate its pair."""
    examples = Examples([], [], [], [])
    for i, (query, texts) in enumerate(queries):
        for j, text in enumerate(texts):
            examples.texts.append(query)
            examples.pairs.append(text)
            examples.labels.append(None)
            examples.where.append(f"{path}: query {i + 1}, text {j}")
    return examples


def ranked(scores: np.ndarray) -> list[int]:
    """Text indices, best first (ties in input order, as a stable sort keeps them)."""
    return [int(i) for i in np.argsort(-scores, kind="stable")]


def main(argv=None) -> int:
    args = rerank_parser(__doc__).parse_args(argv)
    wrong = output_over_inputs(args.output, [args.input], [args.model])
    if not wrong and args.output.exists() and not args.overwrite:
        wrong = f"--output {args.output}: exists; give --overwrite to replace it, or another path"
    if not wrong and args.batch_size < 1:
        wrong = f"--batch-size must be at least 1, got {args.batch_size}"
    if wrong:
        return refuse(wrong)
    try:
        queries = read_queries(args.input)  # the input's mistakes before the model loads
    except ExampleError as err:
        return refuse(err)
    except OSError as err:
        return refuse(describe_os_error(err))
    from packed_transformers.door.exported_folder import is_exported
    from packed_transformers.door.opener import open_folder
    from packed_transformers.inference.classify import classify_examples
    from packed_transformers.inference.options import InferenceOptions
    from packed_transformers.inference.runner import runner_of, runtime_problem
    from packed_transformers.model.hf_checkpoint import quiet_transformers

    quiet_transformers(args.verbose)
    try:
        folder = open_folder(args.model)
        if folder.spec.task != "classification" or len(folder.spec.labels) != 1:
            raise ExampleError(
                f"--model {args.model}: a {folder.spec.task} folder of {len(folder.spec.labels)} labels; packed rerank "
                "runs a one-label sequence-classification folder (a cross-encoder)"
            )
        problem = runtime_problem(args.runtime, args.device, args.dtype, False, False)
        if problem and not is_exported(args.model):  # an exported folder's graph settles its own
            raise ExampleError(problem)
        runner = runner_of(folder, args.device, args.dtype, False, args.runtime)
        examples = pairs_of(queries, args.input)
        started = time.perf_counter()
        logits, timing, data = classify_examples(
            folder,
            runner,
            examples,
            np.zeros(len(examples), dtype=np.int64),
            InferenceOptions.from_args(args),
        )
        seconds = time.perf_counter() - started
    except (ExampleError, ValueError) as err:
        return refuse(err)
    except OSError as err:
        return refuse(describe_os_error(err))
    logit = logits[:, 0].astype(np.float64)
    scores = logit if args.raw_scores else 1.0 / (1.0 + np.exp(-logit))
    lines, first = [], 0
    for i, (_, texts) in enumerate(queries):
        own = scores[first : first + len(texts)]
        first += len(texts)
        lines.append(json.dumps({"index": i, "scores": [float(s) for s in own], "ranking": ranked(own)}))
    try:
        with atomic_path(args.output) as tmp:
            tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    except OSError as err:
        return refuse(describe_os_error(err, f"--output {args.output}"))
    print(json.dumps({"queries": len(queries), "pairs": len(examples), "seconds": round(seconds, 3),
                      "pairs_per_second": round(len(examples) / max(seconds, 1e-9), 1), "truncated": data.truncated,
                      "runtime": runner.runtime, "output": str(args.output)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
