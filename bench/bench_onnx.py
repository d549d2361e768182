"""Packed embeddings against ONNX Runtime and OpenVINO on the same texts and threads (issue 60).

    python bench/bench_onnx.py [--texts 1000] [--rounds 3] [--threads 2]

sentence-transformers' own `backend="onnx"` does not import with the pinned transformers
(optimum-onnx imports a function transformers 5 removed), so the ONNX Runtime way here is
what such a user writes instead: the MiniLM folder's encoder exported once with
`torch.onnx.export` (the export a user would run:

    export_onnx(FOLDER, "minilm.onnx") below: transformers.AutoModel's encoder wrapped to take
    input_ids, attention_mask, token_type_ids by name, torch.onnx.export with the batch and
    token axes dynamic (the TorchScript exporter, dynamo=False)

), an `onnxruntime.InferenceSession` (fp32, intra-op threads = --threads) fed as
sentence-transformers feeds its model: texts sorted by length, 32 per batch, padded to the
batch's longest, mean pooling over the mask, then L2-normalised.

OpenVINO (where it is installed: requirements-bench.txt pins it) compiles the same exported
file (`openvino.Core().compile_model("minilm.onnx", "CPU", {"INFERENCE_PRECISION_HINT":
"f32", "INFERENCE_NUM_THREADS": threads})`: fp32 asked for, since on a CPU with AMX its
default is bf16) and is fed the same batches. sentence-transformers' `backend="openvino"`
needs optimum-intel, which has the same import problem as its ONNX backend.

Four ways on three length profiles of BBC News (data/embedding_texts.py: sentences,
paragraphs, mixed), rounds alternating the order, texts/s (median) and paired ratios:

  encode    SentenceTransformer.encode(batch_size=32), torch
  onnx      the ONNX Runtime session above
  openvino  the OpenVINO compiled model above
  packed    inference.embedding.packed_encode on the same SentenceTransformer (this project)

In one process, after a warm-up of each way: whole-process figures (imports, loading) are
not here. The vectors are compared (min cosine against encode's).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from packed_transformers.common.telemetry import (  # noqa: E402
    decline_onnxruntime_telemetry,
    decline_openvino_telemetry,
)

decline_openvino_telemetry()  # the OpenVINO and ONNX Runtime peers send no usage events from our benches either
decline_onnxruntime_telemetry()  # (set in the environment: the peers' own processes inherit it)


def export_onnx(folder: Path, path: Path) -> None:
    import torch
    import transformers

    model = transformers.AutoModel.from_pretrained(folder).eval()

    class ByName(torch.nn.Module):  # the forward's inputs by name (its positional order has changed)
        def __init__(self):
            super().__init__()
            self.encoder = model  # a submodule: its weights export as weights

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                token_type_ids=token_type_ids).last_hidden_state  # fmt: skip

    ids = torch.ones(2, 16, dtype=torch.long)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    with torch.no_grad():
        torch.onnx.export(ByName().eval(), (ids, ids, torch.zeros_like(ids)), str(path), input_names=names,
                      output_names=["last_hidden_state"], dynamic_axes={n: {0: "batch", 1: "tokens"} for n in names},
                      dynamo=False)  # fmt: skip


def onnx_runtime(path: Path, threads: int):
    """feeds -> last hidden states [B, T, H], through an ONNX Runtime session (fp32)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(["last_hidden_state"], feeds)[0]


def openvino_runtime(path: Path, threads: int):
    """feeds -> last hidden states, through OpenVINO's CPU plugin, fp32 asked for; None where
    openvino is not installed."""
    try:
        import openvino
    except ImportError:
        return None
    compiled = openvino.Core().compile_model(
        str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads}
    )
    request = compiled.create_infer_request()
    output = compiled.output("last_hidden_state")
    return lambda feeds: request.infer(feeds)[output]


def openvino_int8_runtime_of(path: Path, threads: int):
    """feeds -> last hidden states through OpenVINO's CPU plugin from an int8 model saved
    before (NNCF's quantization, bench_embed --int8-peers), as a user's process runs it: read,
    compiled with the threads asked for, nothing else set."""
    import openvino

    compiled = openvino.Core().compile_model(str(path), "CPU", {"INFERENCE_NUM_THREADS": threads})
    request = compiled.create_infer_request()
    output = compiled.output("last_hidden_state")
    return lambda feeds: request.infer(feeds)[output]


def transformers_batches(tokenizer, max_length: int = 256):
    """texts -> padded int64 feeds, by a transformers tokenizer (imports torch with it)."""

    def tokenize(texts):
        batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="np")
        return {
            name: batch[name].astype(np.int64) for name in ("input_ids", "attention_mask", "token_type_ids")
        }

    return tokenize


def tokenizers_batches(folder: Path, max_length: int = 256):
    """texts -> padded int64 feeds, by the folder's tokenizer.json through `tokenizers` alone
    (what a torch-free ONNX process uses): truncated at max_length, padded to the longest."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    tokenizer.enable_truncation(max_length)
    tokenizer.enable_padding()

    def tokenize(texts):
        encoded = tokenizer.encode_batch(texts)
        return {
            "input_ids": np.array([e.ids for e in encoded], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encoded], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encoded], dtype=np.int64),
        }

    return tokenize


class SortedBatchEncoder:
    """sentence-transformers' batching over a runtime (`run`: feeds -> hidden states): sorted,
    32 per batch, padded (`tokenize`: texts -> feeds), mean pooling, normalised."""

    def __init__(self, run, tokenize):
        self.run, self.tokenize = run, tokenize

    def encode(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        order = np.argsort([-len(t) for t in texts], kind="stable")  # sentence-transformers: longest first
        out = None  # [texts, hidden]: the model's width, known at the first batch
        for first in range(0, len(texts), batch_size):
            chosen = order[first : first + batch_size]
            feeds = self.tokenize([texts[i] for i in chosen])
            hidden = self.run(feeds)
            mask = feeds["attention_mask"][..., None].astype(np.float32)
            pooled = (hidden * mask).sum(1) / np.maximum(mask.sum(1), 1e-9)
            out = np.empty((len(texts), pooled.shape[1]), dtype=np.float32) if out is None else out
            out[chosen] = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
        return out


def timed(call, texts):
    started = time.perf_counter()
    result = call(texts)
    return time.perf_counter() - started, result


def main() -> int:
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    from packed_transformers.data.assets import corpus_glob, model_dir
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of
    from packed_transformers.inference.embedding import packed_encode

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--profiles",
        nargs="+",
        choices=("sentences", "paragraphs", "mixed"),
        default=["sentences", "paragraphs", "mixed"],
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    st_model = SentenceTransformer(str(model_dir()), device="cpu")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir())
    articles = bbc_articles(corpus_glob())
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "minilm.onnx"
        export_onnx(model_dir(), path)
        ways = {
            "encode": lambda texts: st_model.encode(texts, batch_size=32, convert_to_numpy=True),
            "onnx": SortedBatchEncoder(
                onnx_runtime(path, args.threads), transformers_batches(tokenizer)
            ).encode,
        }
        openvino = openvino_runtime(path, args.threads)
        if openvino is not None:
            ways["openvino"] = SortedBatchEncoder(openvino, transformers_batches(tokenizer)).encode
        ways["packed"] = lambda texts: packed_encode(st_model, texts)
        peers = [name for name in ways if name != "packed"]
        for profile in args.profiles:
            pool = texts_of(articles, profile)
            picks = np.random.default_rng(0).choice(len(pool), size=min(args.texts, len(pool)), replace=False)
            texts = [pool[i] for i in picks]
            for call in ways.values():  # warm-up
                call(texts[:64])
            seconds = {name: [] for name in ways}
            vectors = {}
            for r in range(args.rounds):
                names = list(ways) if r % 2 == 0 else list(reversed(ways))
                for name in names:
                    took, vectors[name] = timed(ways[name], texts)
                    seconds[name].append(took)
            rate = {name: len(texts) / statistics.median(s) for name, s in seconds.items()}
            paired = {other: statistics.median(o / p for o, p in zip(seconds[other], seconds["packed"]))
                      for other in peers}  # fmt: skip
            cosine = {
                name: float((vectors[name] * vectors["encode"]).sum(1).min())
                for name in ways
                if name != "encode"
            }
            row = {"profile": profile, "texts": len(texts), "texts_per_second": rate,
                   "packed_over": paired, "min_cosine_to_encode": cosine}  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    names = {"encode": "encode (torch)", "onnx": "ONNX Runtime", "openvino": "OpenVINO", "packed": "packed"}
    print("\n| profile | " + " | ".join(f"{names[n]}, texts/s" for n in ways) + " | "
          + " | ".join(f"packed / {names[n]}" for n in peers) + " | min cosine to encode |")  # fmt: skip
    print("|---|" + "---|" * (len(ways) + len(peers) + 1))
    for row in rows:
        print(f"| {row['profile']} | " + " | ".join(f"{row['texts_per_second'][n]:.1f}" for n in ways) + " | "
              + " | ".join(f"{row['packed_over'][n]:.2f}x" for n in peers) + " | "
              + f"{min(row['min_cosine_to_encode'].values()):.7f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
