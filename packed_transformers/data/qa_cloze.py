"""An extractive QA set from BBC News, for the QA demo where no SQuAD can be installed:
cloze questions in the manner of Hermann et al. (2015), "Teaching Machines to Read and
Comprehend" (CNN / Daily Mail), written out in SQuAD's own layouts.

    python -m packed_transformers.data.qa_cloze --input "$(python -m packed_transformers.data.assets corpus)" --output-dir demo_qa

The recipe (deterministic: sorted files, one seed):
  1. An article is its title (first line) and paragraphs; its first paragraph (the lede,
     which BBC writes as a summary; skipped over 60 words) and its title are the question
     sources, the paragraphs after the lede the context.
  2. Candidate answers in the lede: runs of capitalised words (names, places, firms) and
     numbers ("76%", "$1.13bn"), not the lede's first word and not a lone function word.
  3. A candidate that also occurs in the body (as whole words) gives one question: the
     source with the candidate replaced by "@placeholder"; the context starts 0 or 1
     paragraphs (seeded) before the candidate's first paragraph, and the gold answer is
     its first occurrence in the context. At most --questions-per-article per article.
  4. The context's length is drawn from SQuAD v1.1's published window-length histogram at
     384 tokens (packing/histograms/squad_384.json): the target window length minus the
     question's, cut back to a sentence end; a draw of the histogram's last bin (384, the
     windows SQuAD cut) takes the whole article, so that some questions need several
     windows, as in SQuAD. A question whose answer falls outside its cut context is not
     made.
  5. Articles, not questions, are split into train and dev (--dev-fraction by a seeded
     permutation): no article's text is in both.

Output: train.jsonl (the `datasets` JSON-lines layout) and dev.json (SQuAD's official
nested JSON), so that both readers are exercised; README-style stats on stdout, including
a trivial baseline's EM / F1 on dev (the most frequent candidate of the context that is
not in the question).
"""

from __future__ import annotations

import glob
import json
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from packed_transformers.common.cli import command_parser, refuse
from packed_transformers.common.files import atomic_path
from packed_transformers.data.create_pretraining_data import read_document

HISTOGRAM = Path(__file__).resolve().parent.parent / "packing" / "histograms" / "squad_384.json"
PLACEHOLDER = "@placeholder"
CANDIDATE = re.compile(
    r"(?<![\w$£€])(?:[$£€]?\d[\d.,]*(?:%|bn|m|k)?|[A-Z][\w&'-]*(?:\s+(?:of\s+)?[A-Z][\w&'-]*)*)(?![\w])"
)
FUNCTION_WORDS = set(
    "A An The In On At Of For But And Or If It Its He She They We I You His Her Their This That "
    "These Those There Here Mr Mrs Ms Dr When While After Before As By From With Without Some "
    "Many Most Both One Two Three".split()
)
MAX_QUESTION_WORDS = 60
TOKENS_PER_WORD = 1.3  # WordPiece tokens per whitespace word in English news, roughly


def candidates(text: str, skip_first: bool = True) -> list[tuple[str, int]]:
    """(candidate, character start) pairs in text order, first occurrences only."""
    seen, out = set(), []
    for match in CANDIDATE.finditer(text):
        value = match.group(0).rstrip(".,")
        if (skip_first and match.start() == 0) or value in FUNCTION_WORDS or len(value) < 2:
            continue
        if value not in seen:
            seen.add(value)
            out.append((value, match.start()))
    return out


def find_whole(text: str, value: str) -> int:
    match = re.search(r"(?<![\w$£€])" + re.escape(value) + r"(?![\w])", text)
    return -1 if match is None else match.start()


def cut_context(paragraphs: list[str], target_words: int | None) -> str:
    """Paragraphs joined, cut at the last sentence end within target_words (None: all)."""
    text = " ".join(paragraphs)
    if target_words is None:
        return text
    words = text.split(" ")
    if len(words) <= target_words:
        return text
    head = " ".join(words[:target_words])
    end = max(head.rfind(". "), head.rfind(".\u201d"), head.rfind('." '))
    return head[: end + 1] if end > 0 else head


def window_targets(rng, n: int) -> np.ndarray:
    """n window lengths (tokens) drawn from SQuAD's published histogram at 384."""
    counts = np.asarray(json.loads(HISTOGRAM.read_text())["counts"], dtype=np.float64)
    return rng.choice(np.arange(1, len(counts) + 1), size=n, p=counts / counts.sum())


def build(files: list[Path], seed: int, per_article: int, dev_fraction: float):
    """-> (train questions, dev questions, notes); a question is a flat SQuAD record."""
    rng = np.random.default_rng(seed)
    dev_articles = set(rng.permutation(len(files))[: int(round(dev_fraction * len(files)))].tolist())
    targets = window_targets(rng, len(files) * per_article)
    train, dev, notes, drawn = [], [], [], 0
    for a, path in enumerate(files):
        text, legacy = read_document(path)
        if legacy:
            notes.append(f"{path} is not UTF-8; read as cp1252")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if len(lines) < 3:
            continue
        title, lede, body = lines[0], lines[1], lines[2:]
        if len(lede.split()) > MAX_QUESTION_WORDS:
            lede = ""  # a lede that long is no question (SQuAD's are ~11 words; windows need room)
        made, used = 0, set()
        for source, skip_first in ((lede, True), (title, False)):
            for value, _ in candidates(source, skip_first):
                if made == per_article or value in used:
                    continue
                # The context starts at a paragraph before the answer's first one (0-1 back,
                # seeded), so that the answer is inside it, not always at its start.
                first = next((i for i, p in enumerate(body) if find_whole(p, value) >= 0), None)
                if first is None:
                    continue
                question = re.sub(r"(?<![\w$£€])" + re.escape(value) + r"(?![\w])", PLACEHOLDER, source)
                target = int(targets[drawn % len(targets)])
                drawn += 1
                room_words = int((target - 3) / TOKENS_PER_WORD) - len(question.split())
                begin = max(0, first - int(rng.integers(0, 2)))
                context = cut_context(body[begin:], None if target >= 384 else max(room_words, 30))
                start = find_whole(context, value)
                if start < 0:
                    continue
                record = {
                    "id": f"{path.parent.name}-{path.stem}-{made}",
                    "title": title,
                    "question": question,
                    "context": context,
                    "answers": {"text": [value], "answer_start": [start]},
                }
                (dev if a in dev_articles else train).append(record)
                used.add(value)
                made += 1
    return train, dev, notes


def baseline_answer(question: str, context: str) -> str:
    """The trivial baseline: the context's most frequent candidate absent from the question
    (ties: the earliest)."""
    counts = Counter(m.group(0).rstrip(".,") for m in CANDIDATE.finditer(context))
    options = [
        (value, start) for value, start in candidates(context, skip_first=False) if value not in question
    ]
    if not options:
        return ""
    return max(options, key=lambda item: (counts[item[0]], -item[1]))[0]


def packing_factors(questions: list[dict], vocab_file: Path) -> dict:
    """Sequences per pack (lp, K = 3, 384 tokens) of these questions' windows (the
    reference's windowing, doc_stride 128) and of SQuAD v1.1's published histogram."""
    from packed_transformers.data.qa_data import QaExamples
    from packed_transformers.data.qa_windows import fast_tokenizer, make_windows
    from packed_transformers.data.tokenizer import load_tokenizer
    from packed_transformers.packs.algorithms import pack
    from packed_transformers.packs.histogram import Histogram

    examples = QaExamples(
        [q["id"] for q in questions],
        [q["question"] for q in questions],
        [q["context"] for q in questions],
        [None] * len(questions),
        [q["id"] for q in questions],
    )
    _, vocab = load_tokenizer(vocab_file)
    lengths = make_windows(examples, fast_tokenizer(vocab), 384, 128).lengths
    ours = Histogram.from_lengths(lengths, 384)
    squad = Histogram.from_json_file(HISTOGRAM)
    return {
        "this_set": round(pack(ours, "lp", 3).packing_factor, 3),
        "squad_1_1": round(pack(squad, "lp", 3).packing_factor, 3),
        "this_set_mean_window_tokens": round(float(lengths.mean()), 1),
        "squad_1_1_mean_window_tokens": round(squad.real_tokens / squad.sequences, 1),
    }


def official_layout(questions: list[dict]) -> dict:
    """SQuAD v1.1's nested JSON: one article per title, one paragraph per context."""
    articles: dict[str, dict] = {}
    for q in questions:
        article = articles.setdefault(q["title"], {"title": q["title"], "paragraphs": []})
        paragraphs = article["paragraphs"]
        if not paragraphs or paragraphs[-1]["context"] != q["context"]:
            paragraphs.append({"context": q["context"], "qas": []})
        answers = [
            {"text": t, "answer_start": s} for t, s in zip(q["answers"]["text"], q["answers"]["answer_start"])
        ]
        paragraphs[-1]["qas"].append({"id": q["id"], "question": q["question"], "answers": answers})
    return {"version": "1.1", "data": list(articles.values())}


def main(argv=None) -> int:
    parser = command_parser("python -m packed_transformers.data.qa_cloze", __doc__)
    parser.add_argument("--input", required=True, help="glob of BBC News <class>/<nnn>.txt files")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=2015)
    parser.add_argument("--questions-per-article", type=int, default=4)
    parser.add_argument("--dev-fraction", type=float, default=0.15)
    parser.add_argument(
        "--vocab", type=Path, default=None, help="vocab.txt for the window statistics (default: MiniLM's)"
    )
    args = parser.parse_args(argv)
    files = sorted(Path(p) for p in glob.glob(args.input))
    if not files:
        return refuse(f"--input {args.input}: no files match")
    if not 0 < args.dev_fraction < 1 or args.questions_per_article < 1:
        return refuse("--dev-fraction must be in (0, 1) and --questions-per-article >= 1")
    if args.vocab is None:
        from packed_transformers.data import assets

        args.vocab = assets.vocab_file()
    train, dev, notes = build(files, args.seed, args.questions_per_article, args.dev_fraction)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.output_dir / "train.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in train), encoding="utf-8")
    with atomic_path(args.output_dir / "dev.json") as tmp:
        tmp.write_text(json.dumps(official_layout(dev), ensure_ascii=False), encoding="utf-8")
    from packed_transformers.data.squad_metrics import squad_scores

    baseline = squad_scores(
        {q["id"]: baseline_answer(q["question"], q["context"]) for q in dev},
        {q["id"]: q["answers"]["text"] for q in dev},
    )
    stats = {
        "articles": len(files),
        "train_questions": len(train),
        "dev_questions": len(dev),
        "notes": notes,
        "dev_baseline_most_frequent_candidate": baseline,
        "packing_factor_lp_k3_384": packing_factors(train + dev, args.vocab),
    }
    print(json.dumps(stats, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
