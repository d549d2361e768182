"""`python -m packed_transformers.data.train_vocab`: a BERT WordPiece vocab.txt learned from a corpus.

    python -m packed_transformers.data.train_vocab --input 'corpus/*/*.txt' --vocab-size 4096 --output vocab.txt

Why: the demo trains a 2-layer, 64-wide BERT on 2 CPU cores. With bert-base-uncased's
30,522 tokens its output layer (30,522 x 64 per masked slot) is about 70% of every step,
and in two minutes such a model has not yet learned beyond token frequencies. A
vocabulary learned from the corpus itself (4,096 pieces) makes the step about 3x cheaper
and the task learnable at that scale; every other part of the pipeline is unchanged.

The vocabulary comes from `tokenizers`' WordPiece trainer (uncased, accents stripped, as
bert-base-uncased): [PAD] [UNK] [CLS] [SEP] [MASK] first, then single characters, then
pieces by frequency; continuation pieces carry BERT's `##` prefix. Files are read as
create_pretraining_data reads them (UTF-8, else cp1252, named on stderr). The vocabulary
sees every input file: it is a tokenizer choice, as BERT's was made on its whole corpus,
and it holds no label.

The file appears by atomic rename; bad input is one line on stderr and exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

from packed_transformers.common.cli import command_parser, refuse
from packed_transformers.common.files import atomic_path, describe_os_error, output_over_inputs
from packed_transformers.data.create_pretraining_data import _read_text, expand
from packed_transformers.data.reference_tokenizer import read_vocab
from packed_transformers.data.tokenizer import DataInputError

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# Far above any BERT vocabulary (bert-base 30,522; XLM-R 250,002), far below what makes the
# trainer allocate tens of GB inside Rust and abort the process.
MAX_VOCAB_SIZE = 1_000_000


def train_vocab(files: list[Path], vocab_size: int, min_frequency: int) -> list[str]:
    """The vocabulary's tokens in id order (at most `vocab_size`)."""
    from tokenizers import BertWordPieceTokenizer

    tokenizer = BertWordPieceTokenizer(lowercase=True, strip_accents=True, clean_text=True)
    tokenizer.train_from_iterator(
        (_read_text(path) for path in files),
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    vocab = tokenizer.get_vocab()
    return sorted(vocab, key=vocab.__getitem__)


def main(argv=None) -> int:
    parser = command_parser("python -m packed_transformers.data.train_vocab", __doc__)
    parser.add_argument(
        "--input", required=True, nargs="+", help="text files or globs (one document per file)"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=4096, help="tokens in the vocabulary, specials included"
    )
    parser.add_argument("--min-frequency", type=int, default=2, help="a piece must occur this often")
    parser.add_argument("--output", required=True, type=Path, help="vocab.txt to write")
    args = parser.parse_args(argv)
    try:
        if not len(SPECIAL_TOKENS) < args.vocab_size <= MAX_VOCAB_SIZE:
            raise DataInputError(
                f"--vocab-size must be in {len(SPECIAL_TOKENS) + 1}..{MAX_VOCAB_SIZE}, got {args.vocab_size}"
            )
        if args.min_frequency < 1:
            raise DataInputError(f"--min-frequency must be >= 1, got {args.min_frequency}")
        files = expand(args.input)
        clash = output_over_inputs(args.output, files)
        if clash:
            raise DataInputError(clash)
        tokens = train_vocab(files, args.vocab_size, args.min_frequency)
        if len(tokens) <= len(SPECIAL_TOKENS):
            raise DataInputError(f"{' '.join(args.input)}: no text to learn from (the files are empty)")
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(args.output) as tmp:
            tmp.write_text("".join(token + "\n" for token in tokens), encoding="utf-8")
            read_vocab(tmp)  # data creation's reader accepts it (no repeated token), or no file
    except DataInputError as err:
        return refuse(err)
    except OSError as err:
        return refuse(describe_os_error(err))
    print(f"wrote {args.output}: {len(tokens)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
