"""Where the packed forward's time goes, by operator class, in each graph runtime (issue 106,
item 2: is attention's block-diagonal mask worth removing, and where).

    python bench/profile_operators.py [--texts 1000] [--threads 2] [--rounds 3]

The packed rows `packed embed` runs for --texts BBC texts of mixed length (MiniLM-L6 as the
embedding model sentence-transformers describes), through:
  onnxruntime   the graph `packed export` writes (inference.onnx_graphs: the additive
                block-diagonal mask built once per batch, added to every layer's scores, then
                Softmax, as plain ops) beside the same export with each layer's attention as
                ONNX Runtime's fused MultiHeadAttention fed that mask as its attention bias
                (FusedAttention below: the candidate "after"), float32 and dynamic int8: ONNX
                Runtime's own profiler (kernel time per node), and each graph's wall time over
                every batch in the product's session (inference.onnx_session), best of
                --rounds, interleaved. The fused graph's vectors are checked against the
                plain one's (max difference printed; over 1e-4 ends the run with status 1).
  openvino      the converted graph (inference.openvino_graphs: torch's SDPA with the boolean
                block-diagonal mask becomes OpenVINO's ScaledDotProductAttention, one fused op a
                layer), compiled per row shape as the product compiles it, f32 and (on a CPU
                that computes it) bf16, OpenVINO's performance counters (real time per node)
Printed: each runtime's share of kernel time per operator type (the top ones), the count of
fused attention ops and Softmax ops in each graph, and the ONNX Runtime graphs' wall times.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_onnx_static import packed_rows  # noqa: E402 (the rows packed embed runs)


def fused_attention_class():
    """FusedAttention: the packed attention as ONNX Runtime's MultiHeadAttention (contrib domain
    com.microsoft) in an exported graph: scaled scores, the additive block-diagonal bias
    [B, 1, S, S] (broadcast over heads), softmax and the product with the values in one kernel a
    layer. In torch (what the exporter traces) the same arithmetic. query, key, value float
    [B, S, H], projected with their biases; heads: the head count. -> context [B, S, H]."""
    import math

    import torch

    class FusedAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value, bias, heads):
            b, s, width = query.shape

            def split(x):  # [B, S, H] -> [B, heads, S, H / heads]
                return x.view(b, s, heads, width // heads).transpose(1, 2)

            scores = split(query) @ split(key).transpose(-1, -2) / math.sqrt(width // heads) + bias
            return (torch.softmax(scores, dim=-1) @ split(value)).transpose(1, 2).reshape(b, s, width)

        @staticmethod
        def symbolic(g, query, key, value, bias, heads):
            # inputs 3 and 4 (a packed projection bias, a key padding mask) absent: the
            # projections stay MatMuls, which dynamic int8 reaches, and the mask is the bias
            absent = g.op("prim::Constant")
            absent.setType(torch._C.OptionalType.ofTensor())
            context = g.op("com.microsoft::MultiHeadAttention", query, key, value, absent, absent, bias,
                           num_heads_i=heads)  # fmt: skip
            context.setType(query.type())
            return context

    return FusedAttention


@contextlib.contextmanager
def fused_attention():
    """While it lasts, PackedSelfAttention's dense backend (the one the ONNX export runs:
    inference.onnx_graphs.dense_attention) is FusedAttention."""
    import torch

    from packed_transformers.model.attention import PackedSelfAttention

    fused, plain = fused_attention_class(), PackedSelfAttention.forward

    def forward(self, hidden, mask):
        if self.backend != "dense":
            return plain(self, hidden, mask)
        return fused.apply(self.query(hidden), self.key(hidden), self.value(hidden), mask, self.heads)

    PackedSelfAttention.forward = forward
    try:
        with (
            warnings.catch_warnings()
        ):  # the traced forward's shapes as numbers: its symbolic is what is kept
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            yield
    finally:
        PackedSelfAttention.forward = plain


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


def fused_difference(graphs: dict[str, Path], rows: list[dict], output: str, threads: int) -> float:
    """Max absolute difference between the fused and the plain float32 graphs' `output` over
    every batch."""
    from packed_transformers.inference.onnx_session import OnnxSession

    plain, fused = (OnnxSession(graphs[f"float32 {form}"], threads) for form in ("plain ops (the product's)",
                                                                              "fused MultiHeadAttention"))  # fmt: skip
    return max(float(np.abs(plain(batch)[output] - fused(batch)[output]).max()) for batch in rows)


def wall_seconds(
    graphs: dict[str, Path], rows: list[dict], threads: int, rounds: int
) -> dict[str, list[float]]:
    """Each graph's seconds over every batch of `rows` in the product's session, after a warm
    pass; rounds interleaved, every other one in reverse order."""
    import time

    from packed_transformers.inference.onnx_session import OnnxSession

    sessions = {name: OnnxSession(graph, threads) for name, graph in graphs.items()}
    for session in sessions.values():
        for batch in rows:
            session(batch)
    seconds = {name: [] for name in sessions}
    for r in range(rounds):
        for name in list(sessions) if r % 2 == 0 else list(reversed(sessions)):
            started = time.perf_counter()
            for batch in rows:
                sessions[name](batch)
            seconds[name].append(round(time.perf_counter() - started, 3))
    return seconds


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
    parser.add_argument("--rounds", type=int, default=3, help="wall-time rounds of the ONNX Runtime graphs")
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
        graphs = {}
        for form, fused in (("plain ops (the product's)", False), ("fused MultiHeadAttention", True)):
            fp32, int8 = Path(scratch) / f"fp32-{fused}.onnx", Path(scratch) / f"int8-{fused}.onnx"
            with fused_attention() if fused else contextlib.nullcontext():
                (output,) = export_graph(model, rows[0], "float32", fp32)
            quantize_int8(fp32, int8)
            nodes = onnx.load(str(fp32)).graph.node
            print(f"onnxruntime graph {form}: {sum(n.op_type == 'MultiHeadAttention' for n in nodes)} "
                  f"MultiHeadAttention, {sum(n.op_type == 'Softmax' for n in nodes)} Softmax, "
                  f"{sum(n.op_type == 'Add' for n in nodes)} Add ops")  # fmt: skip
            graphs[f"float32 {form}"], graphs[f"int8 (dynamic) {form}"] = fp32, int8
        difference = fused_difference(graphs, rows, output, args.threads)
        print(f"fused against plain float32: max |difference| {difference:.1e} over every vector")
        for name, graph in graphs.items():
            print(f"- onnxruntime {name}: {shares(onnxruntime_profile(graph, rows, args.threads), args.top)}",
                  flush=True)  # fmt: skip
        seconds = wall_seconds(graphs, rows, args.threads, args.rounds)
        print(f"\nonnxruntime wall s over every batch, best of {args.rounds} (each round's in brackets):")
        for name, times in seconds.items():
            print(f"- {name}: {min(times):.2f} {times}")
        print()
    graphs = OpenVinoGraphs(model, "float32", args.threads)
    graphs.convert(rows[0])
    kinds = collections.Counter(op.get_type_name() for op in graphs.converted.get_ops())
    if difference > 1e-4:
        print("the fused graph computes other vectors than the plain one", file=sys.stderr)
        return 1
    print(
        f"openvino graph: {kinds['ScaledDotProductAttention']} ScaledDotProductAttention ops (one fused op per layer)"
    )
    for precision in ("f32", "bf16") if native_bf16("cpu") else ("f32",):
        print(f"- openvino {precision}: {shares(openvino_profile(graphs.converted, graphs.input_names, rows, precision, args.threads), args.top)}",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
