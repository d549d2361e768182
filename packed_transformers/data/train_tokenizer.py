"""`packed train-tokenizer`: a byte-level BPE tokenizer folder learned from JSON-lines text.

    packed train-tokenizer --input docs.jsonl --vocab-size 1024 --output work/tokenizer

Why: a small decoder pretrained on 2 CPU cores spends most of its step in the output layer
when the vocabulary is Llama 3.1's 128,256 tokens; a vocabulary learned from the corpus keeps
the step cheap (as data.train_vocab does for the BERT demo). GPT-2's scheme: bytes first (any
text encodes, nothing is unknown), merges by frequency, `<|endoftext|>` as the end-of-sequence
token (id 0). The folder is transformers' own (`AutoTokenizer.from_pretrained` reads it), so
`packed pack-documents --tokenizer` and every model command take it like any other.
"""

from __future__ import annotations

import sys
from pathlib import Path

from packed_transformers.common.cli import command_parser, interruptible, refuse, run_main

EOS = "<|endoftext|>"
MIN_VOCAB, MAX_VOCAB = 257 + 1, 1_000_000  # the 256 bytes and EOS at least


def train_tokenizer(texts: list[str], vocab_size: int):
    """transformers' PreTrainedTokenizerFast over a byte-level BPE of `vocab_size` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS, pad_token=EOS)


def main(argv=None) -> int:
    parser = command_parser("packed train-tokenizer", __doc__)
    parser.add_argument("--input", nargs="+", required=True, help="JSON-lines files, one document per line")
    parser.add_argument("--vocab-size", type=int, default=1024, help="tokens, EOS included (>= 258)")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--output", required=True, type=Path, help="tokenizer folder to write")
    args = parser.parse_args(argv)
    from packed_transformers.common.files import atomic_folder, describe_os_error, output_folder_mistake
    from packed_transformers.data.classification_data import ExampleError
    from packed_transformers.data.documents import read_documents

    if not MIN_VOCAB <= args.vocab_size <= MAX_VOCAB:
        return refuse(f"--vocab-size must be in {MIN_VOCAB}..{MAX_VOCAB}, got {args.vocab_size}")
    # a folder: an earlier tokenizer folder (its tokenizer.json) is replaced, any other refused
    mistake = output_folder_mistake(args.output, [Path(p) for p in args.input], "tokenizer.json")
    if mistake:
        return refuse(mistake)
    try:
        texts = read_documents([Path(p) for p in args.input], args.text_field).texts
        print(
            f"{len(texts):,} documents read; learning {args.vocab_size:,} tokens", file=sys.stderr, flush=True
        )
        tokenizer = interruptible(train_tokenizer, texts, args.vocab_size)  # Ctrl-C within 0.1 s
        with atomic_folder(args.output) as tmp:
            tokenizer.save_pretrained(tmp)
    except ExampleError as err:
        return refuse(str(err))
    except OSError as err:
        return refuse(describe_os_error(err))
    print(f"wrote {args.output}: {len(tokenizer)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "no tokenizer was written (it appears only when complete)"))
