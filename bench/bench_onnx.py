"""Packed embeddings against ONNX Runtime on the same texts and threads (issue 60).

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

Three ways on three length profiles of BBC News (data/embedding_texts.py: sentences,
paragraphs, mixed), rounds alternating the order, texts/s (median) and paired ratios:

  encode  SentenceTransformer.encode(batch_size=32), torch
  onnx    the ONNX Runtime session above
  packed  finetune.embedding.packed_encode on the same SentenceTransformer (this project)

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


class OnnxEncoder:
    """sentence-transformers' batching over an ONNX Runtime session: sorted, 32 per batch,
    padded, mean pooling, normalised."""

    def __init__(self, path: Path, tokenizer, threads: int, max_length: int = 256):
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.tokenizer, self.max_length = tokenizer, max_length

    def encode(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        order = np.argsort([-len(t) for t in texts], kind="stable")  # sentence-transformers: longest first
        out = np.empty((len(texts), 384), dtype=np.float32)
        for first in range(0, len(texts), batch_size):
            chosen = order[first : first + batch_size]
            batch = self.tokenizer([texts[i] for i in chosen], padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="np")  # fmt: skip
            feeds = {
                name: batch[name].astype(np.int64)
                for name in ("input_ids", "attention_mask", "token_type_ids")
            }
            hidden = self.session.run(["last_hidden_state"], feeds)[0]
            mask = feeds["attention_mask"][..., None].astype(np.float32)
            pooled = (hidden * mask).sum(1) / np.maximum(mask.sum(1), 1e-9)
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

    from data.assets import corpus_glob, model_dir
    from data.embedding_texts import bbc_articles, texts_of
    from finetune.embedding import packed_encode

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
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
        onnx = OnnxEncoder(path, tokenizer, args.threads)
        ways = {
            "encode": lambda texts: st_model.encode(texts, batch_size=32, convert_to_numpy=True),
            "onnx": onnx.encode,
            "packed": lambda texts: packed_encode(st_model, texts),
        }
        for profile in ("sentences", "paragraphs", "mixed"):
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
                      for other in ("encode", "onnx")}  # fmt: skip
            cosine = {
                name: float((vectors[name] * vectors["encode"]).sum(1).min()) for name in ("onnx", "packed")
            }
            row = {"profile": profile, "texts": len(texts), **{f"{k}_texts_per_second": v for k, v in rate.items()},
                   "packed_over_encode": paired["encode"], "packed_over_onnx": paired["onnx"],
                   "onnx_over_encode": rate["onnx"] / rate["encode"], "min_cosine": cosine}  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    print(
        "\n| profile | encode, texts/s | ONNX Runtime | packed | packed / encode | packed / ONNX Runtime | ONNX / encode |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['profile']} | {row['encode_texts_per_second']:.1f} | {row['onnx_texts_per_second']:.1f} | "
              f"{row['packed_texts_per_second']:.1f} | {row['packed_over_encode']:.2f}x | {row['packed_over_onnx']:.2f}x "
              f"| {row['onnx_over_encode']:.2f}x |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
