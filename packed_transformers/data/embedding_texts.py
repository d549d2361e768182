"""Texts to embed, from the BBC News corpus: titles, sentences and paragraphs (short and
long mixed, as a search index holds), and title -> article pairs for a retrieval check.

    python -m packed_transformers.data.embedding_texts --output texts.jsonl [--kind mixed|titles|sentences|paragraphs|articles]
        [--limit N]

Each output line is {"text": ...}; `mixed` interleaves every article's title, its
sentences and its paragraphs in corpus order; `articles` gives each article whole (title,
then its paragraphs): documents for language-model pretraining. `pairs` gives one
{"anchor": title, "positive": its first two paragraphs} a line: short queries and long
passages, what contrastive training of an embedding model learns from (data.task: embedding).
"""

from __future__ import annotations

import glob
import json
import sys
from pathlib import Path

from packed_transformers.common.cli import command_parser, refuse
from packed_transformers.common.files import atomic_path
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.data.create_pretraining_data import read_document, split_sentences

KINDS = ("mixed", "titles", "sentences", "paragraphs", "articles", "pairs")


def bbc_articles(pattern: str) -> list[dict]:
    """Every article matching `pattern` (…/<class>/<nnn>.txt), sorted by path:
    {"title", "paragraphs": [...], "sentences": [...], "body"}."""
    files = sorted(Path(p) for p in glob.glob(pattern))
    if not files:
        raise ExampleError(f"{pattern}: no files match (expected BBC News <class>/<nnn>.txt files)")
    articles = []
    for path in files:
        text, _ = read_document(path)
        blocks = [block.strip() for block in text.split("\n\n") if block.strip()]
        lines = blocks[0].splitlines() if blocks else [""]
        title, paragraphs = lines[0].strip(), ["\n".join(lines[1:]).strip(), *blocks[1:]]
        paragraphs = [" ".join(p.split()) for p in paragraphs if p.strip()]
        body = " ".join(paragraphs)
        articles.append(
            {"title": title, "paragraphs": paragraphs, "sentences": split_sentences(body), "body": body}
        )
    return articles


def texts_of(articles: list[dict], kind: str = "mixed") -> list[str]:
    out = []
    for article in articles:
        if kind in ("mixed", "titles"):
            out.append(article["title"])
        if kind in ("mixed", "sentences"):
            out.extend(article["sentences"])
        if kind in ("mixed", "paragraphs"):
            out.extend(article["paragraphs"])
        if kind == "articles":  # a whole document (language-model pretraining's unit)
            out.append(article["title"] + "\n\n" + "\n\n".join(article["paragraphs"]))
    return out


def pairs_of(articles: list[dict]) -> list[dict]:
    """(title, first two paragraphs) of every article with a title and a body."""
    return [{"anchor": a["title"], "positive": " ".join(a["paragraphs"][:2])} for a in articles
            if a["title"] and a["paragraphs"]]  # fmt: skip


def main(argv=None) -> int:
    from packed_transformers.data.assets import MissingAsset, corpus_glob

    parser = command_parser("python -m packed_transformers.data.embedding_texts", __doc__)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--kind", default="mixed", choices=KINDS)
    parser.add_argument("--input", default=None, help="BBC News glob (default: the installed corpus)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many texts")
    args = parser.parse_args(argv)
    try:
        articles = bbc_articles(args.input or corpus_glob())
        if args.kind == "pairs":
            records = pairs_of(articles)[: args.limit]
        else:
            records = [{"text": text} for text in texts_of(articles, args.kind)[: args.limit]]
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(args.output) as tmp, tmp.open("w") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
    except (ExampleError, OSError, MissingAsset) as err:  # MissingAsset: no corpus (the light install)
        return refuse(err)
    print(f"{len(records)} {'pairs' if args.kind == 'pairs' else 'texts'} -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
