"""Packed embeddings against sentence-transformers' `encode`, as whole processes.

    python bench/bench_embed.py [--texts 4000] [--rounds 3] [--threads 2] [--dtype float32]
        [--profile mixed | paragraphs | sentences] [--peers]

The same BBC News texts (titles, sentences and paragraphs: short and long mixed,
data/embedding_texts.py) as a JSON-lines file; each round runs, alternately and in a
rotating order, in fresh interpreters with the same torch thread count:

  st-encode     sentence-transformers: SentenceTransformer(folder).encode(texts,
                batch_size=32) (its default length sorting), saved with numpy
  embed-sorted  python -m packed_transformers.finetune.embed --batching sorted (the same batching as encode)
  embed-packed  python -m packed_transformers.finetune.embed --batching packed (the default)

With --peers (fp32 only), also the runtimes a user would otherwise reach for, each a whole
process over the same texts that imports no torch: the MiniLM encoder exported once to ONNX
before the rounds (bench/bench_onnx.py's `export_onnx`; the export is not timed, a user does
it once), then fed as sentence-transformers feeds its model (sorted, 32 per batch, padded,
mean pooling, normalised: bench_onnx's `SortedBatchEncoder`; the folder's tokenizer.json
through `tokenizers`, truncated at 256 tokens as the folder's max_seq_length):

  onnxruntime   an onnxruntime InferenceSession, fp32, intra-op threads = --threads
  openvino      OpenVINO's CPU plugin, fp32 asked for, threads = --threads (if installed)
  embed-openvino  python -m packed_transformers.finetune.embed --runtime openvino: the packed rows
                through OpenVINO (converted and compiled per row shape inside the process, timed)
  fastembed     FastEmbed as its users run it (if installed): TextEmbedding("sentence-transformers/
                all-MiniLM-L6-v2", threads=--threads) with its defaults (256 texts a batch in input
                order, padded to the batch's longest, ONNX Runtime fp32, mean pooling, normalised),
                from a local folder (`specific_model_path`) holding the same exported graph as
                model.onnx, the name FastEmbed's MiniLM file has, and the folder's tokenizer files
                (truncating at 256 tokens, as FastEmbed describes its MiniLM)

With --int8-peers, int8 against the int8 ways a CPU user would otherwise run, whole processes
over the same texts, each quantized once before the rounds (not timed, as a user quantizes
once), st-encode kept as the vectors' reference:

  embed-int8           python -m packed_transformers.finetune.embed --dtype int8 (torch's fbgemm kernels)
  embed-openvino-int8  ... --runtime openvino --dtype int8 (calibrated on its input's first texts;
                       the graph cache a fresh folder: round 0 quantizes, later rounds read it)
  onnxruntime-int8     ONNX Runtime on quantize_dynamic of the optimized graph (bench_int8's)
  openvino-int8        OpenVINO on NNCF's static quantization of the exported encoder (model type
                       TRANSFORMER, calibrated on 300 BBC texts apart from the measured ones, saved)
  embed-onnxruntime-int8  ... --runtime onnxruntime --dtype int8: the packed graph through ONNX
                       Runtime's dynamic int8 (the graph cache a fresh folder: round 0 exports)
  exported-int8        `packed embed` on a folder `packed export --dtype int8` wrote before the rounds
                       (not timed, as the peers quantize once): the torch-free process

  exported-openvino-int8  `packed embed` on a folder `packed export --runtime openvino --dtype int8
                       --calibration F` wrote (NNCF's static int8 on openvino-int8's 300 calibration
                       texts; OpenVINO + tokenizers, no torch), on a CPU with VNNI only
  exported-openvino-bf16  the same, `--dtype bfloat16`, on a CPU that computes bf16 only

embed-int8 and embed-openvino-int8 are left out on a CPU without VNNI, where both are refused.
With --peers, also exported-fp32 (the same, float32), exported-openvino-fp32 (`packed export
--runtime openvino`) and embed-onnxruntime (--runtime onnxruntime).

Each is timed twice: the whole process (interpreter start, imports, model load, reading,
writing: what a user waits for) and its own encode loop. The vectors of every run are
compared with sentence-transformers' (cosine per text). Prints a markdown table and the
paired ratios (median over rounds of packed / st-encode within a round).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))  # bench_onnx's export and batching

ST_SCRIPT = """
import json, sys, time, numpy as np, torch
torch.set_num_threads(int(sys.argv[4]))
from sentence_transformers import SentenceTransformer
texts = [json.loads(line)["text"] for line in open(sys.argv[2])]
kwargs = {"model_kwargs": {"dtype": torch.bfloat16}} if sys.argv[5] == "bfloat16" else {}
model = SentenceTransformer(sys.argv[1], device="cpu", **kwargs)
started = time.perf_counter()
vectors = model.encode(texts, batch_size=32, convert_to_numpy=True)
seconds = time.perf_counter() - started
np.save(sys.argv[3], vectors.astype(np.float32))
print(json.dumps({"texts": len(texts), "seconds": seconds}))
"""

PEER_SCRIPT = """
import json, sys, time
sys.path.insert(0, sys.argv[6])
import numpy as np
from bench_onnx import SortedBatchEncoder, onnx_runtime, openvino_int8_runtime_of, openvino_runtime, tokenizers_batches
texts = [json.loads(line)["text"] for line in open(sys.argv[2])]
runtime = {"onnxruntime": onnx_runtime, "openvino": openvino_runtime, "onnxruntime-int8": onnx_runtime,
           "openvino-int8": openvino_int8_runtime_of}[sys.argv[5]]
encoder = SortedBatchEncoder(runtime(sys.argv[1], int(sys.argv[4])), tokenizers_batches(sys.argv[7]))
started = time.perf_counter()
vectors = encoder.encode(texts)
seconds = time.perf_counter() - started
np.save(sys.argv[3], vectors)
print(json.dumps({"texts": len(texts), "seconds": seconds, "torch": "torch" in sys.modules}))
"""


FASTEMBED_SCRIPT = """
import json, sys, time
import numpy as np
from fastembed import TextEmbedding
texts = [json.loads(line)["text"] for line in open(sys.argv[2])]
model = TextEmbedding("sentence-transformers/all-MiniLM-L6-v2", specific_model_path=sys.argv[1], threads=int(sys.argv[4]))
started = time.perf_counter()
vectors = np.stack(list(model.embed(texts)))
seconds = time.perf_counter() - started
np.save(sys.argv[3], vectors.astype(np.float32))
print(json.dumps({"texts": len(texts), "seconds": seconds, "torch": "torch" in sys.modules}))
"""


def fastembed_folder(folder: Path, exported: Path, scratch: Path) -> Path:
    """A folder FastEmbed loads MiniLM from without the hub: the exported graph as model.onnx
    beside the model folder's tokenizer and config files."""
    import shutil

    target = scratch / "fastembed"
    target.mkdir()
    shutil.copy(exported, target / "model.onnx")
    for name in ("tokenizer.json", "special_tokens_map.json", "config.json"):
        if (folder / name).is_file():
            shutil.copy(folder / name, target / name)
    # FastEmbed truncates at tokenizer_config's model_max_length; its MiniLM is described as "256
    # input tokens truncation" (the model's max_seq_length, where sentence-transformers cuts too),
    # while the folder's tokenizer_config says 512: 256, so every system encodes the same tokens
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "model_max_length": 256}))
    return target


def int8_peer_models(
    folder: Path, scratch: Path, texts: list[str], picks, calibration_texts: int = 300
) -> dict[str, Path]:
    """--int8-peers: the peers' int8 models, made once as their users make them: ONNX Runtime's
    quantize_dynamic of the optimized graph (bench_int8.onnx_int8_graphs) and NNCF's static
    quantization of the exported encoder for OpenVINO, calibrated on `calibration_texts` (300)
    BBC texts not among the measured ones (bench_int8's way), saved as OpenVINO IR."""
    import nncf
    import openvino
    import transformers
    from bench_int8 import onnx_int8_graphs
    from bench_onnx import export_onnx, transformers_batches

    from packed_transformers.data.assets import corpus_glob
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of

    exported = scratch / "int8" / "minilm.onnx"
    exported.parent.mkdir()
    export_onnx(folder, exported)
    _, onnx_int8 = onnx_int8_graphs(exported, folder)
    pool = texts_of(bbc_articles(corpus_glob()), "mixed")
    measured = set(texts)
    apart = [t for t in pool if t not in measured]
    drawn = np.random.default_rng(2).choice(
        len(apart), size=min(calibration_texts, len(apart)), replace=False
    )
    calibration = sorted((apart[i] for i in drawn), key=len)
    feed = transformers_batches(transformers.AutoTokenizer.from_pretrained(folder))
    feeds = [feed(calibration[i : i + 32]) for i in range(0, len(calibration), 32)]
    quantized = nncf.quantize(openvino.Core().read_model(str(exported)), nncf.Dataset(feeds),
                              model_type=nncf.ModelType.TRANSFORMER, subset_size=len(feeds))  # fmt: skip
    openvino.save_model(quantized, str(scratch / "int8" / "minilm_int8.xml"))
    # the same texts calibrate our OpenVINO int8 export (exported-openvino-int8)
    texts_file = scratch / "int8" / "calibration.jsonl"
    texts_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in calibration))
    return {"onnxruntime-int8": onnx_int8, "openvino-int8": scratch / "int8" / "minilm_int8.xml",
            "calibration": texts_file}  # fmt: skip


def run(argv: list[str], threads: int) -> tuple[float, dict]:
    # ORT_DISABLE_TELEMETRY: no peer sends ONNX Runtime's usage events (common/telemetry.py)
    env = dict(
        os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", ORT_DISABLE_TELEMETRY="1"
    )
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed: {done.stderr[-2000:]}")
    return wall, json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    from packed_transformers.data.assets import corpus_glob, model_dir
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--profile", default="mixed", choices=("mixed", "paragraphs", "sentences"),
        help="mixed: titles, sentences and paragraphs; paragraphs: paragraphs (median ~110 tokens) "
        "plus one in six passages of four paragraphs (cut at max_seq_length); sentences: the bodies' sentences",
    )  # fmt: skip
    parser.add_argument("--peers", action="store_true", help="also ONNX Runtime and OpenVINO (fp32)")
    parser.add_argument(
        "--int8-peers", action="store_true", help="int8: ours against ONNX Runtime's and OpenVINO's"
    )
    parser.add_argument(
        "--calibration", type=int, default=300, help="--int8-peers: texts OpenVINO's int8 is calibrated on"
    )
    args = parser.parse_args()
    if args.peers and args.dtype != "float32":
        parser.error("--peers: the peers run fp32 only")
    if args.int8_peers and (args.peers or args.dtype != "float32"):
        parser.error("--int8-peers: alone, without --peers or --dtype")
    if args.profile in ("mixed", "sentences"):
        texts = texts_of(bbc_articles(corpus_glob()), args.profile)
    else:
        paragraphs = texts_of(bbc_articles(corpus_glob()), "paragraphs")
        starts = np.random.default_rng(1).choice(
            len(paragraphs) - 4, size=len(paragraphs) // 5, replace=False
        )
        texts = paragraphs + [" ".join(paragraphs[j : j + 4]) for j in starts]
    picks = np.random.default_rng(0).choice(len(texts), size=min(args.texts, len(texts)), replace=False)
    texts = [texts[i] for i in picks]
    # the graphs our runtimes compile in this run (not the user's ~/.cache, whose warm graphs
    # would hide the compile a first call pays), removed at its end
    graph_cache = tempfile.TemporaryDirectory(prefix="bench-embed-graphs-")
    model = str(model_dir())
    results: dict[str, list] = {"st-encode": [], "embed-sorted": [], "embed-packed": []}
    if args.int8_peers:
        from packed_transformers.inference.runtime_choice import cpu_flags, has_vnni

        ours = ("embed-int8", "embed-openvino-int8") if has_vnni(cpu_flags()) else ()
        results = {name: [] for name in ("st-encode", *ours, "embed-onnxruntime-int8", "exported-int8",
                                         "onnxruntime-int8", "openvino-int8")}  # fmt: skip
        if has_vnni(cpu_flags()):
            results["exported-openvino-int8"] = []
        if {"avx512_bf16", "amx_bf16"} & cpu_flags():
            results["exported-openvino-bf16"] = []
        os.environ["PACKED_TRANSFORMERS_CACHE"] = graph_cache.name
    if args.peers:
        import importlib.util

        results["onnxruntime"] = []
        results["embed-onnxruntime"] = []
        results["exported-fp32"] = []
        os.environ["PACKED_TRANSFORMERS_CACHE"] = graph_cache.name
        if importlib.util.find_spec("openvino") is not None:
            results["openvino"] = []
            results["embed-openvino"] = []
            results["exported-openvino-fp32"] = []
        if importlib.util.find_spec("fastembed") is not None:
            results["fastembed"] = []
    with tempfile.TemporaryDirectory() as scratch:
        if args.peers:
            from bench_onnx import export_onnx

            exported = Path(scratch) / "minilm.onnx"
            export_onnx(Path(model), exported)
            if "fastembed" in results:
                fastembed_model = fastembed_folder(Path(model), exported, Path(scratch))
        if args.int8_peers:
            quantized = int8_peer_models(Path(model), Path(scratch), texts, picks, args.calibration)
        source = Path(scratch) / "texts.jsonl"
        source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        outputs = {name: Path(scratch) / f"{name}.npy" for name in results}
        exports = {}
        for name in [name for name in results if name.startswith("exported-")]:
            exports[name] = Path(scratch) / name
            dtype = {"int8": "int8", "bf16": "bfloat16"}.get(name.rsplit("-", 1)[1], "float32")
            runtime = "openvino" if name.startswith("exported-openvino") else "onnxruntime"
            calibration = (
                ["--calibration", str(quantized["calibration"])] if name == "exported-openvino-int8" else []
            )
            subprocess.run([sys.executable, "-m", "packed_transformers.commands.export", "--model", model,
                            "--output", str(exports[name]), "--dtype", dtype, "--runtime", runtime, *calibration],
                           cwd=REPO, check=True, capture_output=True)  # fmt: skip

        def argv_of(name):
            if name == "st-encode":
                return [sys.executable, "-c", ST_SCRIPT, model, str(source), str(outputs[name]),
                        str(args.threads), args.dtype]  # fmt: skip
            if name == "fastembed":
                return [sys.executable, "-c", FASTEMBED_SCRIPT, str(fastembed_model), str(source), str(outputs[name]),
                        str(args.threads)]  # fmt: skip
            if name in ("onnxruntime", "openvino", "onnxruntime-int8", "openvino-int8"):
                graph = quantized[name] if name.endswith("int8") else exported
                return [sys.executable, "-c", PEER_SCRIPT, str(graph), str(source), str(outputs[name]),
                        str(args.threads), name, str(REPO / "bench"), model]  # fmt: skip
            if name in exports:  # the folder fixes runtime and dtype
                return [sys.executable, "-m", "packed_transformers.commands.embed", "--model", str(exports[name]),
                        "--input", str(source), "--output", str(outputs[name]), "--quiet", "--overwrite"]  # fmt: skip
            graph_runtime = next(
                (r for r in ("openvino", "onnxruntime") if name.startswith(f"embed-{r}")), None
            )
            batching = "packed" if graph_runtime or name == "embed-int8" else name.split("-")[1]
            runtime = ["--runtime", graph_runtime] if graph_runtime else []
            dtype = "int8" if name.endswith("int8") else args.dtype
            return [sys.executable, "-m", "packed_transformers.finetune.embed", "--model", model, "--input", str(source),
                    "--output", str(outputs[name]), "--batching", batching, "--dtype", dtype,
                    "--quiet", "--overwrite", *runtime]  # fmt: skip

        names = list(results)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                wall, report = run(argv_of(name), args.threads)
                results[name].append({"wall": wall, "encode": report["seconds"]})
                if report.get("torch"):
                    raise RuntimeError(f"{name} imported torch: not the torch-free process it stands for")
                print(f"round {round_} {name}: {wall:.1f} s whole, {report['seconds']:.1f} s encoding",
                      file=sys.stderr, flush=True)  # fmt: skip
        reference = np.load(outputs["st-encode"])
        agreement = {}
        for name in names:
            vectors = np.load(outputs[name])
            cos = (vectors * reference).sum(1) / (
                np.linalg.norm(vectors, axis=1) * np.linalg.norm(reference, axis=1)
            )
            agreement[name] = float(cos.min())
    n = len(texts)
    print(f"# {n} BBC News texts (profile {args.profile}), {args.threads} threads, {args.dtype}, "
          f"{args.rounds} rounds; texts/s, median (range)")  # fmt: skip
    print("| run | whole process | encode loop | min cosine vs st-encode |")
    print("|---|---|---|---|")
    for name in names:
        whole = [n / r["wall"] for r in results[name]]
        loop = [n / r["encode"] for r in results[name]]
        print(f"| {name} | {np.median(whole):.1f} ({min(whole):.1f}-{max(whole):.1f}) | "
              f"{np.median(loop):.1f} ({min(loop):.1f}-{max(loop):.1f}) | {agreement[name]:.7f} |")  # fmt: skip
    for name in [name for name in ("embed-packed", "embed-sorted") if name in results]:
        whole = [s["wall"] / p["wall"] for s, p in zip(results["st-encode"], results[name])]
        loop = [s["encode"] / p["encode"] for s, p in zip(results["st-encode"], results[name])]
        print(f"\n{name} / st-encode, paired per round: whole process {np.median(whole):.2f}x "
              f"({min(whole):.2f}-{max(whole):.2f}), encode loop {np.median(loop):.2f}x ({min(loop):.2f}-{max(loop):.2f})")  # fmt: skip
    for ours in [name for name in ("embed-packed", "embed-openvino", "embed-onnxruntime", "exported-fp32",
                                   "exported-openvino-fp32", "embed-int8", "embed-openvino-int8",
                                   "embed-onnxruntime-int8", "exported-int8", "exported-openvino-int8",
                                   "exported-openvino-bf16")
                 if name in results]:  # fmt: skip
        for peer in [name for name in ("onnxruntime", "openvino", "fastembed", "onnxruntime-int8", "openvino-int8")
                     if name in results]:  # fmt: skip
            whole = [s["wall"] / p["wall"] for s, p in zip(results[peer], results[ours])]
            loop = [s["encode"] / p["encode"] for s, p in zip(results[peer], results[ours])]
            print(f"{ours} / {peer}, paired per round: whole process {np.median(whole):.2f}x "
                  f"({min(whole):.2f}-{max(whole):.2f}), encode loop {np.median(loop):.2f}x ({min(loop):.2f}-{max(loop):.2f})")  # fmt: skip
    if args.json:
        from bench.machine import description

        written = {"command": "python bench/bench_embed.py " + " ".join(sys.argv[1:]), "machine": description(),
                   "texts": n, "runs": results, "min_cosine": agreement}  # fmt: skip
        args.json.write_text(json.dumps(written, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
