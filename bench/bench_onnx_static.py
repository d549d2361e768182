"""ONNX Runtime's static int8 (QDQ, calibrated) of the packed graph against its dynamic int8 (what
`--runtime onnxruntime --dtype int8` and `packed export --dtype int8` run), on the same packed
rows, in one process (issue 106, item 3: "dynamic int8 kept where it measures faster").

    python bench/bench_onnx_static.py [--texts 1000] [--calibration 300] [--rounds 3] [--threads 2]

The model: MiniLM-L6 as the embedding model sentence-transformers describes (mean pooling,
normalized), its packed forward exported as `packed export` exports it (inference.onnx_graphs,
float32), then quantized three ways by onnxruntime.quantization: dynamic (ours: int8 weights per
output channel, activations quantized per tensor at run time), and static QDQ calibrated by
MinMax on --calibration other texts' packed rows (batched as `packed embed` batches them), int8
weights per output channel, activations per tensor, either signed and symmetric (s8s8) or
unsigned with a zero point (u8s8: x86's VNNI form). Static quantizes the matrix products with a
weight (the dense layers); the attention's two products of activations stay float (quantized,
the min cosine fell to 0.70 in a first try). Texts: --texts BBC texts of mixed length. Each graph runs every row of those texts in
ONNX Runtime's session as the product runs it (inference.onnx_session); best of --rounds;
quality: min cosine per text to the float32 graph's vectors.
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
sys.path.insert(0, str(REPO / "bench"))


class RowsOf:
    """Stands where embedding.calibrate expects a Runner: keeps the packed rows it is given."""

    def __init__(self):
        from packed_transformers.inference.runner import Runner

        self.calibration_rows = Runner.calibration_rows
        self.rows: list[dict] = []

    def calibrate(self, rows: list[dict]) -> None:
        self.rows = rows


def packed_rows(loaded, texts: list[str]) -> list[dict]:
    """The packed rows `packed embed` runs for `texts` (every width group's)."""
    from packed_transformers.inference.embedding import calibrate
    from packed_transformers.inference.options import InferenceOptions

    keeper = RowsOf()
    calibrate(keeper, loaded, [], InferenceOptions.for_embedding(calibration_texts=tuple(texts)))
    return keeper.rows


def quantize_static(fp32: Path, out: Path, calibration: list[dict], unsigned: bool) -> None:
    """Static QDQ int8 of the dense layers' products, MinMax over `calibration`'s rows."""
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType
    from onnxruntime.quantization import quantize_static as quantize

    graph = onnx.load(str(fp32)).graph
    weights = {tensor.name for tensor in graph.initializer}
    inputs = [i.name for i in graph.input]
    of_activations = [n.name for n in graph.node if n.op_type == "MatMul" and not set(n.input) & weights]

    class Feeds(CalibrationDataReader):
        def __init__(self):
            self.left = iter(calibration)

        def get_next(self):
            rows = next(self.left, None)
            return None if rows is None else {name: np.ascontiguousarray(rows[name]) for name in inputs}

    quantize(str(fp32), str(out), Feeds(), quant_format=QuantFormat.QDQ, per_channel=True,
             activation_type=QuantType.QUInt8 if unsigned else QuantType.QInt8, weight_type=QuantType.QInt8,
             op_types_to_quantize=["MatMul"], nodes_to_exclude=of_activations,
             calibrate_method=CalibrationMethod.MinMax,
             extra_options={"ActivationSymmetric": not unsigned, "WeightSymmetric": True,
                            "DefaultTensorType": onnx.TensorProto.FLOAT})  # fmt: skip


def main() -> int:
    import logging

    import torch
    from machine import description, line

    from packed_transformers.data.assets import corpus_glob, model_dir
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of
    from packed_transformers.door.opener import ForEmbedding, open_folder
    from packed_transformers.inference.onnx_graphs import export_graph, quantize_int8
    from packed_transformers.inference.onnx_session import OnnxSession

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--calibration", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger().setLevel(logging.ERROR)  # the quantizer's advice lines
    print(line(description()), flush=True)
    pool = texts_of(bbc_articles(corpus_glob()), "mixed")
    picks = np.random.default_rng(0).choice(
        len(pool), size=min(args.texts + args.calibration, len(pool)), replace=False
    )
    texts, calibration = [pool[i] for i in picks[: args.texts]], [pool[i] for i in picks[args.texts :]]
    loaded = open_folder(model_dir(), ForEmbedding())
    rows, calibration_rows = packed_rows(loaded, texts), packed_rows(loaded, calibration)
    with tempfile.TemporaryDirectory(prefix="bench-onnx-static-") as scratch:
        graphs = {"float32": Path(scratch) / "fp32.onnx"}
        (output,) = export_graph(loaded.model.eval(), rows[0], "float32", graphs["float32"])
        graphs["dynamic int8 (ours)"] = Path(scratch) / "dynamic.onnx"
        quantize_int8(graphs["float32"], graphs["dynamic int8 (ours)"])
        setup = {}
        for name, unsigned in (("static int8 QDQ s8s8", False), ("static int8 QDQ u8s8", True)):
            graphs[name] = Path(scratch) / f"{name.rsplit(' ', 1)[1]}.onnx"
            started = time.perf_counter()
            quantize_static(graphs["float32"], graphs[name], calibration_rows, unsigned)
            setup[name] = time.perf_counter() - started
        sessions = {name: OnnxSession(path, args.threads) for name, path in graphs.items()}
        vectors = {
            name: [session(r)[output] for r in rows] for name, session in sessions.items()
        }  # also warms
        seconds = {name: [] for name in sessions}
        for r in range(args.rounds):
            for name in list(sessions) if r % 2 == 0 else list(reversed(sessions)):
                started = time.perf_counter()
                for batch in rows:
                    sessions[name](batch)
                seconds[name].append(time.perf_counter() - started)
    present = [batch["example_index"] >= 0 for batch in rows]
    reference = np.concatenate([v[m] for v, m in zip(vectors["float32"], present)])
    table = {}
    for name in sessions:
        mine = np.concatenate([v[m] for v, m in zip(vectors[name], present)])
        cosine = (
            (mine * reference).sum(-1) / np.linalg.norm(mine, axis=-1) / np.linalg.norm(reference, axis=-1)
        )
        table[name] = {"best_s": round(min(seconds[name]), 3), "min_cosine": round(float(cosine.min()), 4),
                       "quantize_s": round(setup.get(name, 0.0), 1)}  # fmt: skip
    print(f"\n# {len(texts)} texts ({sum(len(b['input_ids']) for b in rows)} packed rows), calibration "
          f"{len(calibration)} other texts, {args.threads} threads, best of {args.rounds}\n")  # fmt: skip
    print("| graph | best s | min cosine to float32 | quantize s |")
    print("|---|---|---|---|")
    for name, figures in table.items():
        print(f"| {name} | {figures['best_s']:.2f} | {figures['min_cosine']} | {figures['quantize_s']} |")
    if args.json:
        args.json.write_text(json.dumps({"command": "python bench/bench_onnx_static.py " + " ".join(sys.argv[1:]),
                                         "machine": description(), "graphs": table}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
