"""Each finetune command's argument parser, standard library only: `python -m finetune.X`
parses its command line before it imports torch, so `--help`, a mistyped option ("did you
mean --output?"), a missing required option or a value outside its choices is answered in
one line at once (0.1 s, not the 5-7 s of the imports). The command parses again in `main`
with the same parser.

    if __name__ == "__main__":
        from packed_transformers.commands.parsers import predict_parser
        predict_parser(__doc__).parse_args()   # exits 2 (or 0 for --help) on its own
"""

from __future__ import annotations

import argparse
from pathlib import Path

from packed_transformers.common.choices import (
    ATTENTION_BACKENDS,
    BATCHING_MODES,
    EMBED_BATCHING,
    POOLING_MODES,
    RUNTIMES,
)
from packed_transformers.common.cli import (
    add_inference_options,
    add_ray_options,
    add_verbose_option,
    command_parser,
)


def predict_parser(doc: str) -> argparse.ArgumentParser:
    """commands.predict's options (doc: the command's module docstring, for --help)."""
    parser = command_parser("python -m packed_transformers.finetune.predict", doc)
    add_inference_options(parser, "finetune.train output model folder")
    parser.add_argument("--input", required=True, type=Path, help="JSON lines to classify")
    parser.add_argument("--output", required=True, type=Path, help="predictions, JSON lines, input order")
    parser.add_argument("--batching", default="packed", choices=BATCHING_MODES)
    parser.add_argument("--batch-size", type=int, default=64, help="examples per batch")
    parser.add_argument(
        "--pack-length", type=int, default=None, help="tokens per pack (default: the model's)"
    )
    parser.add_argument(
        "--nbest-output", type=Path, default=None, help="question answering: also write the n-best file"
    )
    add_chunk_options(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_compile_option(parser)
    add_runtime_option(parser)
    add_ray_options(parser)
    return parser


def add_chunk_options(parser: argparse.ArgumentParser) -> None:
    """embed's and predict's chunks: the work kept at a time (Ctrl-C keeps every chunk before the one
    it stops), each about --chunk-seconds of it."""
    parser.add_argument(
        "--chunk-texts", type=int, default=8192, help="at most this many texts tokenized and packed at once"
    )
    parser.add_argument(
        "--chunk-seconds", type=float, default=10.0,
        help="rows are kept chunk by chunk, each about this many seconds of work (Ctrl-C keeps all but the last "
        "ones); 0: chunks of --chunk-texts",
    )  # fmt: skip


def embed_parser(doc: str) -> argparse.ArgumentParser:
    """commands.embed's options."""
    parser = command_parser("python -m packed_transformers.finetune.embed", doc)
    add_inference_options(parser, "a sentence-transformers folder, or any BERT folder with --pooling")
    parser.add_argument("--input", required=True, type=Path, help="JSON lines with a text field")
    parser.add_argument("--output", required=True, type=Path, help="the .npy array, float32 [lines, D]")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--batching", default="packed", choices=tuple(EMBED_BATCHING))
    parser.add_argument(
        "--batch-size", type=int, default=32, help="texts per batch (sentence-transformers' 32)"
    )
    parser.add_argument(
        "--pooling", nargs="+", choices=POOLING_MODES, help="default: the folder's Pooling module's mode"
    )
    parser.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="L2-normalize (default: whether the folder has a Normalize module)",
    )
    parser.add_argument(
        "--max-length", type=int, help="tokens per text (default: the folder's max_seq_length)"
    )
    parser.add_argument(
        "--attention-backend", choices=ATTENTION_BACKENDS, help="default: sdpa (measured fastest)"
    )
    add_chunk_options(parser)
    parser.add_argument(
        "--prompt-name",
        help="a prompt of the folder's config_sentence_transformers.json put before every text (default: its "
        "default_prompt_name, as sentence-transformers' encode)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_compile_option(parser)
    add_runtime_option(parser)
    add_ray_options(parser)
    return parser


def add_runtime_option(parser: argparse.ArgumentParser) -> None:
    """--runtime: the batch commands' forward through torch or OpenVINO, or this CPU's measured
    choice of the two (inference.runner, inference.runtime_choice)."""
    parser.add_argument(
        "--runtime",
        default="torch",
        choices=RUNTIMES,
        help="openvino: the packed rows through OpenVINO, one graph compiled for every row shape (float32, or int8 "
        "calibrated on a sample of the input's texts); onnxruntime: through ONNX Runtime, one graph for every "
        "row shape (float32, or dynamic int8); docs/embeddings.md measures them; auto: the one "
        "measured faster on this CPU's kind (torch where it was not measured)",
    )


def export_parser(doc: str) -> argparse.ArgumentParser:
    """commands.export's options."""
    parser = command_parser("packed export", doc)
    parser.add_argument("--model", required=True, type=Path, help="the model folder to export")
    parser.add_argument("--output", required=True, type=Path, help="the export folder (new, or --overwrite)")
    parser.add_argument("--runtime", default="onnxruntime", choices=("onnxruntime", "openvino"),
                        help="the runtime the graph is for (openvino: an IR run by openvino + tokenizers)")  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "int8"),
                        help="int8: ONNX Runtime's dynamic quantization (weights per channel), or with --runtime "
                        "openvino NNCF's static int8 calibrated at export; bfloat16: --runtime openvino on a CPU that "
                        "computes bf16 (AVX512_BF16 or AMX)")  # fmt: skip
    parser.add_argument("--calibration", type=Path,
                        help="--runtime openvino --dtype int8: JSON lines {\"text\"} like the texts to come (300 sampled; "
                        "default: the installed BBC corpus's)")  # fmt: skip
    parser.add_argument(
        "--pooling", nargs="+", choices=POOLING_MODES,
        help="export as an embedding model pooled so (default: the folder's Pooling module's mode)",
    )  # fmt: skip
    parser.add_argument("--embedding", action="store_true",
                        help="export as an embedding model whatever head the folder has")  # fmt: skip
    parser.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                        help="L2-normalize (default: whether the folder has a Normalize module)")  # fmt: skip
    parser.add_argument(
        "--max-length", type=int, help="tokens per text (default: the folder's max_seq_length)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing export folder")
    add_verbose_option(parser)
    return parser


def add_compile_option(parser: argparse.ArgumentParser) -> None:
    """--compile: the batch commands' forward under torch.compile (inference.runner)."""
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the forward once per row width (inductor, frozen weights): pays off on long inputs "
        "only, after the compile time docs/compile.md measures",
    )


def mine_negatives_parser(doc: str) -> argparse.ArgumentParser:
    """commands.mine_negatives' options."""
    parser = command_parser("packed mine-negatives", doc)
    parser.add_argument(
        "--model", required=True, type=Path, help="the embedding model (a sentence-transformers folder)"
    )
    parser.add_argument("--input", required=True, type=Path, help="JSON lines of (query, positive) pairs")
    parser.add_argument(
        "--output", required=True, type=Path, help="JSON lines, each input line with its negatives"
    )
    parser.add_argument(
        "--query-field", default="query", help="the input's query field (the embedding pairs': anchor)"
    )
    parser.add_argument("--positive-field", default="positive")
    parser.add_argument("--corpus", type=Path, help='JSON lines {"text"}: candidates besides the positives')
    parser.add_argument("--negatives", type=int, default=5, help="negatives per line, nearest first")
    parser.add_argument(
        "--range-min", type=int, default=0, help="skip this many nearest candidates (likely positives)"
    )
    parser.add_argument(
        "--range-max", type=int, help="look no further than this rank (default: as sentence-transformers)"
    )
    parser.add_argument(
        "--relative-margin",
        type=float,
        help="drop candidates scoring above the positive's score less |score| x this (false negatives)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="texts per embedding batch")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    add_verbose_option(parser)
    return parser
