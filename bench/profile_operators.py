"""Where the packed forward's time goes, by operator class, in each graph runtime (issue 106,
item 2: is attention's block-diagonal mask worth removing, and where).

    python bench/profile_operators.py [--texts 1000] [--threads 2]

The packed rows `packed embed` runs for --texts BBC texts of mixed length (MiniLM-L6 as the
embedding model sentence-transformers describes), through:
  onnxruntime   the graph `packed export` writes (inference.onnx_graphs: attention exported
                dense, one additive mask built per batch and added to every layer's scores),
                float32 and dynamic int8, ONNX Runtime's own profiler (kernel time per node)
  openvino      the converted graph (inference.openvino_graphs: torch's SDPA with the boolean
                block-diagonal mask becomes OpenVINO's ScaledDotProductAttention, one fused op a
                layer), compiled per row shape as the product compiles it, f32 and (on a CPU
                that computes it) bf16, OpenVINO's performance counters (real time per node)
Printed: each runtime's share of kernel time per operator type (the top ones), and the count
of ScaledDotProductAttention ops and of Add ops fed the [rows, 1, width, width] mask.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_onnx_static import packed_rows  # noqa: E402 (the rows packed embed runs)


def onnxruntime_profile(graph: Path, rows: list[dict], threads: int) -> collections.Counter:
    """Kernel microseconds per operator type over every batch of `rows`, one pass after a warm one."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory(prefix="ort-profile-") as scratch:
        options.enable_profiling, options.profile_file_prefix = True, str(Path(scratch) / "p")
        session = onnxruntime.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        for batch in rows:  # warm (weights packed, buffers sized): its events are dropped below
            session.run(None, {name: batch[name] for name in names})
        warm = len(rows)
        for batch in rows:
            session.run(None, {name: batch[name] for name in names})
        events = json.loads(Path(session.end_profiling()).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    start = runs[warm]["ts"]  # the measured pass's first run
    per_type = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= start:
            per_type[event["args"]["op_name"]] += event["dur"]
    return per_type


def openvino_profile(
    model, names: list[str], rows: list[dict], precision: str, threads: int
) -> collections.Counter:
    """Real microseconds per operator type over every batch of `rows`, each row shape compiled
    on its own (as inference.openvino_session compiles), one pass after a warm one. `names`:
    the row field each of the model's inputs takes, in order."""
    import openvino

    core = openvino.Core()
    config = {"PERF_COUNT": "YES", "INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": threads}
    compiled = {}
    per_type = collections.Counter()
    for measured in (False, True):
        for batch in rows:
            shape = tuple(batch[name].shape for name in sorted(batch))
            if shape not in compiled:
                static = model.clone()
                static.reshape({port: batch[name].shape for port, name in zip(static.inputs, names)})
                compiled[shape] = core.compile_model(static, "CPU", config).create_infer_request()
            request = compiled[shape]
            request.infer([batch[name] for name in names])
            if measured:
                for info in request.profiling_info:
                    per_type[info.node_type] += info.real_time.total_seconds() * 1e6
    return per_type


def shares(per_type: collections.Counter, top: int = 8) -> str:
    total = sum(per_type.values())
    return ", ".join(f"{name} {100 * us / total:.1f}%" for name, us in per_type.most_common(top)) + (
        f" (total {total / 1e6:.2f} s)"
    )


def main() -> int:
    import onnx
    import torch
    from machine import description, line

    from packed_transformers.data.assets import corpus_glob, model_dir
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of
    from packed_transformers.door.opener import ForEmbedding, open_folder
    from packed_transformers.inference.onnx_graphs import export_graph, quantize_int8
    from packed_transformers.inference.openvino_graphs import OpenVinoGraphs
    from packed_transformers.inference.precision import native_bf16

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=10, help="operator types shown per runtime")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(line(description()), flush=True)
    pool = texts_of(bbc_articles(corpus_glob()), "mixed")
    picks = np.random.default_rng(0).choice(len(pool), size=min(args.texts, len(pool)), replace=False)
    loaded = open_folder(model_dir(), ForEmbedding())
    model = loaded.model.eval()
    rows = packed_rows(loaded, [pool[i] for i in picks])
    print(
        f"# {len(picks)} texts, {sum(len(b['input_ids']) for b in rows)} packed rows in {len(rows)} batches\n"
    )
    with tempfile.TemporaryDirectory(prefix="profile-operators-") as scratch:
        fp32, int8 = Path(scratch) / "fp32.onnx", Path(scratch) / "int8.onnx"
        export_graph(model, rows[0], "float32", fp32)
        quantize_int8(fp32, int8)
        nodes = onnx.load(str(fp32)).graph.node
        print(f"onnxruntime graph: {sum(n.op_type == 'Add' for n in nodes)} Add ops, "
              f"{sum(n.op_type == 'Softmax' for n in nodes)} Softmax (one per layer)")  # fmt: skip
        for name, graph in (("onnxruntime float32", fp32), ("onnxruntime int8 (dynamic)", int8)):
            print(f"- {name}: {shares(onnxruntime_profile(graph, rows, args.threads), args.top)}", flush=True)
    graphs = OpenVinoGraphs(model, "float32", args.threads)
    graphs.convert(rows[0])
    kinds = collections.Counter(op.get_type_name() for op in graphs.converted.get_ops())
    print(
        f"openvino graph: {kinds['ScaledDotProductAttention']} ScaledDotProductAttention ops (one fused op per layer)"
    )
    for precision in ("f32", "bf16") if native_bf16("cpu") else ("f32",):
        print(f"- openvino {precision}: {shares(openvino_profile(graphs.converted, graphs.input_names, rows, precision, args.threads), args.top)}",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
