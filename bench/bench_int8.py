"""int8 embeddings against the int8 runtimes a CPU user is told to pick, and fp32 against the
fp32 ones (issue 82): speed side by side in one process, and the quality gates.

    python bench/bench_int8.py [--texts 1000] [--rounds 3] [--threads 2] [--queries 300]

Ways, each fed the same texts with the same threads, after one warm-up call:

  encode       SentenceTransformer.encode(batch_size=32), torch fp32 (what its users run)
  onnx         ONNX Runtime fp32 on the exported encoder after onnxruntime.transformers'
               optimizer (fused attention, LayerNorm, GELU), fed as sentence-transformers
               feeds its backends (bench_onnx.SortedBatchEncoder: sorted, 32 a batch,
               padded to the batch's longest, mean pooling)
  openvino     OpenVINO fp32 on the exported encoder, fed the same way
  packed       this project's packed_encode, fp32
  onnx_int8    ONNX Runtime's quantize_dynamic of the optimized graph (int8 weights per
               channel, uint8 activations per forward): sentence-transformers' efficiency
               guide's int8 ONNX way
  packed_int8  packed_encode(dtype="int8") (inference/int8.py: torch's fbgemm kernels)
  packed_openvino  packed_encode(runtime="openvino"): the packed rows through OpenVINO, a graph
               compiled per row shape (inference/openvino_graphs.py), fp32
  packed_openvino_int8  packed_encode(runtime="openvino", dtype="int8", calibration_texts=...):
               NNCF's static quantization of the packed graph, calibrated on the same
               --calibration texts as openvino_int8

  openvino_int8  OpenVINO's int8: NNCF's post-training static quantization of the exported
               encoder (model_type TRANSFORMER), calibrated on --calibration BBC texts drawn apart
               from the measured ones, fed as above: what sentence-transformers'
               `export_static_quantized_openvino_model` does through optimum-intel (which
               calibrates on 300 GLUE SST-2 sentences)

On a CPU that computes bf16 (AVX512_BF16 or AMX; issue 106 item 4), also:

  openvino_default  OpenVINO on the exported encoder with only the threads set: its own
               precision choice (bf16 on such CPUs by its documentation), fed as above
  packed_bf16  packed_encode(dtype="bfloat16"): torch's bf16 autocast
  packed_openvino_bf16  packed_encode(runtime="openvino", dtype="bfloat16"): the packed graph
               asked for bf16 (INFERENCE_PRECISION_HINT)

Quality gates, each int8 way against the fp32 of the same system (packed fp32 for packed int8,
ONNX Runtime fp32 for its int8, OpenVINO fp32 for its): per-text cosine (min, 1st percentile, median), and retrieval on a set built from BBC
News: an article's title is the query, the bodies of --queries articles the documents
(truncated at 256 tokens, as the model is): recall@10 and nDCG@10 (one relevant document per
query). Results: printed table and docs/figures/int8.json; the machine line names the CPU
and its flags (bench/machine.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_onnx import (  # noqa: E402
    SortedBatchEncoder,
    export_onnx,
    onnx_runtime,
    openvino_runtime,
    transformers_batches,
)
from machine import description, line  # noqa: E402

FP32_OF = {
    "packed_int8": "packed",
    "packed_openvino": "packed",
    "packed_openvino_int8": "packed",
    "onnx_int8": "onnx",
    "openvino_int8": "openvino",
    "packed_bf16": "packed",
    "packed_openvino_bf16": "packed",
    "openvino_default": "openvino",
}  # each int8 (or bf16) way's own fp32 (packed through OpenVINO: against packed torch fp32)
# bf16 CPUs (AVX512_BF16, AMX): the project's bf16 ways and OpenVINO's default precision (bf16 there)
PACKED_BF16 = ("packed_bf16", "packed_openvino_bf16")
PACKED_INT8 = ("packed_int8", "packed_openvino_int8")
PACKED_FP32 = ("packed", "packed_openvino")
INT8_PEERS = ("onnx_int8", "openvino_int8")


def machine_flags() -> list[str]:
    return description()["cpu"]["flags"]


def openvino_default_runtime(exported: Path, threads: int):
    """feeds -> last hidden states through OpenVINO's CPU plugin with its default precision
    (bf16 on a CPU with AVX512_BF16 or AMX), only the threads set."""
    import openvino

    compiled = openvino.Core().compile_model(str(exported), "CPU", {"INFERENCE_NUM_THREADS": threads})
    request = compiled.create_infer_request()
    output = compiled.output("last_hidden_state")
    return lambda feeds: request.infer(feeds)[output]


def openvino_int8_runtime(exported: Path, threads: int, calibration_feeds: list[dict]):
    """feeds -> last hidden states through OpenVINO, the encoder quantized to int8 by NNCF's
    post-training static quantization over `calibration_feeds`; None where openvino or nncf is
    not installed."""
    try:
        import nncf
        import openvino
    except ImportError:
        return None
    core = openvino.Core()
    quantized = nncf.quantize(
        core.read_model(str(exported)),
        nncf.Dataset(calibration_feeds),
        model_type=nncf.ModelType.TRANSFORMER,
        subset_size=len(calibration_feeds),
    )
    compiled = core.compile_model(quantized, "CPU", {"INFERENCE_NUM_THREADS": threads})
    request = compiled.create_infer_request()
    output = compiled.output("last_hidden_state")
    return lambda feeds: request.infer(feeds)[output]


def onnx_int8_graphs(exported: Path, folder: Path) -> tuple[Path, Path]:
    """The exported encoder -> (optimized fp32 graph, its dynamic int8 quantization)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers import optimizer
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    optimized = optimizer.optimize_model(str(exported), model_type="bert", num_heads=config.num_attention_heads,
                                         hidden_size=config.hidden_size)  # fmt: skip
    fp32 = exported.with_name("optimized.onnx")
    optimized.save_model_to_file(str(fp32))
    int8 = exported.with_name("int8.onnx")
    # DefaultTensorType: the optimizer's fused ops (com.microsoft) defeat the quantizer's
    # shape inference; their outputs are float32
    quantize_dynamic(str(fp32), str(int8), per_channel=True, weight_type=QuantType.QInt8,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})  # fmt: skip
    return fp32, int8


def retrieval(queries: np.ndarray, documents: np.ndarray, k: int = 10) -> dict:
    """Query i's relevant document is document i: recall@k and nDCG@k (one relevant each)."""
    scores = queries @ documents.T
    rank = (scores > scores[np.arange(len(queries)), np.arange(len(queries))][:, None]).sum(1)  # 0 = first
    found = rank < k
    return {
        "recall@10": float(found.mean()),
        "ndcg@10": float(np.where(found, 1 / np.log2(rank + 2), 0).mean()),
    }


def cosine_summary(a: np.ndarray, b: np.ndarray) -> dict:
    similar = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
    return {"min": float(similar.min()), "p01": float(np.percentile(similar, 1)),
            "median": float(np.median(similar))}  # fmt: skip


def main() -> int:
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    from packed_transformers.data.assets import corpus_glob, model_dir
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of
    from packed_transformers.inference.embedding import packed_encode
    from packed_transformers.inference.int8 import int8_problem

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--calibration", type=int, default=300, help="texts OpenVINO int8 is calibrated on")
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "figures" / "int8.json")
    args = parser.parse_args()
    problem = int8_problem("cpu")
    bf16_cpu = bool({"avx512_bf16", "amx_bf16"} & set(machine_flags()))
    if problem:  # a CPU kind this bench cannot measure: its row says so, and make bench goes on
        print(f"bench_int8: not measured on this CPU ({line(description())}): {problem}")
        return 0
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    machine = description()
    print(line(machine), flush=True)
    st_model = SentenceTransformer(str(model_dir()), device="cpu")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir())
    articles = bbc_articles(corpus_glob())
    pool = texts_of(articles, "mixed")
    picks = np.random.default_rng(0).choice(len(pool), size=min(args.texts, len(pool)), replace=False)
    texts = [pool[i] for i in picks]
    chosen = np.random.default_rng(1).choice(
        len(articles), size=min(args.queries, len(articles)), replace=False
    )
    titles = [articles[i]["title"] for i in chosen]
    bodies = [articles[i]["body"] for i in chosen]
    with tempfile.TemporaryDirectory() as scratch:
        exported = Path(scratch) / "minilm.onnx"
        export_onnx(model_dir(), exported)
        optimized, quantized = onnx_int8_graphs(exported, model_dir())
        feed = transformers_batches(tokenizer)
        ways = {
            "encode": lambda t: st_model.encode(t, batch_size=32, convert_to_numpy=True),
            "onnx": SortedBatchEncoder(onnx_runtime(optimized, args.threads), feed).encode,
            "packed": lambda t: packed_encode(st_model, t),
            "onnx_int8": SortedBatchEncoder(onnx_runtime(quantized, args.threads), feed).encode,
            "packed_int8": lambda t: packed_encode(st_model, t, dtype="int8"),
        }
        openvino = openvino_runtime(exported, args.threads)
        others = np.setdiff1d(np.arange(len(pool)), picks)
        drawn = np.random.default_rng(2).choice(
            others, size=min(args.calibration, len(others)), replace=False
        )
        calibration = sorted((pool[i] for i in drawn), key=len)
        if openvino is not None:
            ways["packed_openvino"] = lambda t: packed_encode(st_model, t, runtime="openvino")
            ways["packed_openvino_int8"] = lambda t: packed_encode(
                st_model, t, runtime="openvino", dtype="int8", calibration_texts=tuple(calibration)
            )
            ways["openvino"] = SortedBatchEncoder(openvino, feed).encode
            feeds = [feed(calibration[i : i + 32]) for i in range(0, len(calibration), 32)]
            openvino_int8 = openvino_int8_runtime(exported, args.threads, feeds)
            if openvino_int8 is not None:
                ways["openvino_int8"] = SortedBatchEncoder(openvino_int8, feed).encode
            if bf16_cpu:  # OpenVINO as its users run it (threads set, its own precision: bf16 here)
                ways["openvino_default"] = SortedBatchEncoder(
                    openvino_default_runtime(exported, args.threads), feed
                ).encode
                ways["packed_openvino_bf16"] = lambda t: packed_encode(
                    st_model, t, runtime="openvino", dtype="bfloat16"
                )
        if bf16_cpu:
            ways["packed_bf16"] = lambda t: packed_encode(st_model, t, dtype="bfloat16")
        first_call = {}  # warm-up over the measured texts: every graph built and compiled, weights packed
        for name, call in ways.items():
            started = time.perf_counter()
            call(texts)
            first_call[name] = time.perf_counter() - started
        seconds = {name: [] for name in ways}
        vectors = {}
        for r in range(args.rounds):
            for name in list(ways) if r % 2 == 0 else list(reversed(ways)):
                started = time.perf_counter()
                vectors[name] = ways[name](texts)
                seconds[name].append(time.perf_counter() - started)
        quality = {name: cosine_summary(vectors[name], vectors[fp32]) for name, fp32 in FP32_OF.items()
                   if name in vectors and fp32 in vectors}  # fmt: skip
        search = {name: retrieval(ways[name](titles), ways[name](bodies))
                  for name in ("packed", "packed_int8", "packed_openvino", "packed_openvino_int8", "onnx", "onnx_int8",
                               "openvino", "openvino_int8", *PACKED_BF16, "openvino_default")
                  if name in ways}  # fmt: skip
    best = {name: min(s) for name, s in seconds.items()}
    fastest_int8_peer = min((n for n in INT8_PEERS if n in best), key=best.get)
    fastest_fp32_peer = min((n for n in ("encode", "onnx", "openvino") if n in best), key=best.get)
    packed_int8 = min((n for n in PACKED_INT8 if n in best), key=best.get)
    packed_fp32 = min((n for n in PACKED_FP32 if n in best), key=best.get)
    result = {
        "machine": machine, "texts": len(texts), "threads": args.threads, "rounds": args.rounds,
        "seconds": seconds, "best_seconds": best, "first_call_seconds": first_call,
        "packed_int8_over_fastest_int8_peer": best[fastest_int8_peer] / best[packed_int8],
        "fastest_int8_peer": fastest_int8_peer, "fastest_packed_int8": packed_int8,
        "packed_over_fastest_fp32_peer": best[fastest_fp32_peer] / best[packed_fp32],
        "fastest_fp32_peer": fastest_fp32_peer, "fastest_packed_fp32": packed_fp32,
        "cosine_to_own_fp32": quality, "retrieval": search,
        "command": "python bench/bench_int8.py " + " ".join(sys.argv[1:]),
    }  # fmt: skip
    print("\n| way | best s | texts/s | first call s |")
    print("|---|---|---|---|")
    for name, value in sorted(best.items(), key=lambda kv: kv[1]):
        print(f"| {name} | {value:.2f} | {len(texts) / value:.1f} | {first_call[name]:.1f} |")
    print(f"\n{packed_int8} / {fastest_int8_peer}: {result['packed_int8_over_fastest_int8_peer']:.2f}x; "
          f"{packed_fp32} / {fastest_fp32_peer}: {result['packed_over_fastest_fp32_peer']:.2f}x")  # fmt: skip
    bf16 = [n for n in PACKED_BF16 if n in best]
    if bf16 and "openvino_default" in best:
        fastest_bf16 = min(bf16, key=best.get)
        result["bf16"] = {"fastest_packed_bf16": fastest_bf16,
                          "over_openvino_default": best["openvino_default"] / best[fastest_bf16],
                          "min_cosine": quality[fastest_bf16]["min"]}  # fmt: skip
        print(f"{fastest_bf16} / openvino_default (OpenVINO's own precision): {result['bf16']['over_openvino_default']:.2f}x, "
              f"min cosine to fp32 {result['bf16']['min_cosine']:.6f}")  # fmt: skip
    print("cosine to own fp32:", json.dumps(quality))
    print("retrieval:", json.dumps(search))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
