"""Export a model folder for the torch-free process: the packed graph, the tokenizer and what
the read-out needs, in one folder that `packed embed`, `packed predict` and `packed serve`
run with neither torch nor transformers imported (door.exported_folder).

    packed export --model DIR --output OUT [--runtime onnxruntime] [--dtype float32 | int8]
        [--pooling mean] [--normalize | --no-normalize] [--max-length N]
    packed export --model DIR --output OUT --runtime openvino [--dtype float32 | bfloat16 | int8]
        [--calibration texts.jsonl]

DIR: a sentence-transformers folder (or any encoder folder with --pooling): an embedding
export; a classification folder (finetune.train's, or a transformers folder with a
sequence-classification head): a classification export. The graph is exported with rows,
width and slots open: for ONNX Runtime (inference.onnx_graphs) float32 or its dynamic int8;
for OpenVINO (inference.openvino_graphs' conversion, saved as an IR) float32, or the same IR
run in bf16 where the CPU computes it (AVX512_BF16, AMX; the folder's dtype says so and a CPU
without bf16 refuses it at load), or NNCF's static int8 (embedding models; a CPU with VNNI),
calibrated here on --calibration's texts (JSON lines; default: 300 of the installed BBC
corpus's), never at a user's first call. Then checked before the folder appears: the exported graph
run by its runtime on packed rows of varied widths and slot counts against the torch model on
the same rows (float32: cosine >= 0.99999 per text, the same labels; int8 and bfloat16: reported). OUT appears complete or not at all
(atomic rename); it never replaces the model folder. A one-line JSON summary goes to stdout.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # option and path mistakes answered before torch is imported
    from packed_transformers.commands.parsers import export_parser
    from packed_transformers.common.preflight import exit_on_path_mistakes

    export_parser(__doc__).parse_args()
    exit_on_path_mistakes({"--model": "folder"})

import json
from pathlib import Path

import numpy as np

from packed_transformers.commands.parsers import export_parser
from packed_transformers.common.choices import EXPORTED, GRAPH_TASKS
from packed_transformers.common.cli import refuse
from packed_transformers.common.files import (
    FolderInUse,
    atomic_folder,
    describe_os_error,
    lock_folder,
    model_fingerprint,
    output_folder_mistake,
)
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.door.export_checks import EXPORT_DTYPES_OF
from packed_transformers.door.exported_folder import EXPORT_FORMAT, ExportInfo, is_exported, spec_fields
from packed_transformers.inference.onnx_session import onnxruntime_problem

FP32_MIN_COSINE = 0.99999  # the exported float32 graph against torch, per text


def check_rows(vocabulary: int, longest: int, seed: int = 0) -> list[np.ndarray]:
    """Token id lists of a few packs' worth of made-up texts (ids below `vocabulary`, at most
    `longest` tokens): varied lengths, so that the check runs rows of several widths and slot
    counts through both models."""
    rng = np.random.default_rng(seed)
    lengths = [min(n, longest) for n in (3, 9, 17, 30, 5, 64, 2, 12, 40, 7)]
    return [rng.integers(5, vocabulary, size=n).astype(np.int64) for n in lengths]


def tables_for_check(lengths: list[int]) -> list[tuple[np.ndarray, int]]:
    """(table, width) pairs over the check texts: one text a row, two and three a row, one
    wide row: every axis of the graph takes more than one size."""
    n = len(lengths)
    order = list(range(n))
    tables = [np.array([[i] for i in order[:4]]), np.array([[4, 5], [6, 7]]), np.array([[8, 9, 0]])]
    out = []
    for table in tables:
        width = int(max(sum(lengths[i] for i in row if i >= 0) for row in table.tolist()))
        out.append((table, width + 3))
    return out


def graph_session(runtime: str, graph_path: Path, dtype: str, threads: int):
    """A session of the exported graph in its runtime (rows in, outputs by name out)."""
    if runtime == "openvino":
        from packed_transformers.inference.openvino_session import OpenVinoSession

        return OpenVinoSession(graph_path, dtype, threads)
    from packed_transformers.inference.onnx_session import OnnxSession

    return OnnxSession(graph_path, threads)


def compare(model, loaded, graph_path: Path, runtime: str, dtype: str, task: str) -> dict:
    """The exported graph against the torch model on the same packed rows -> figures
    (min cosine per text, label agreement for classification); ExampleError where float32
    differs beyond FP32_MIN_COSINE."""
    import torch

    from packed_transformers.inference.runner import Runner

    session = graph_session(runtime, graph_path, dtype, torch.get_num_threads())
    runner = Runner(model, "cpu", "float32")  # the packed forward, as predict and embed run it
    name = "embeddings" if task == "embedding" else "logits"
    texts = check_rows(model.config.vocab_size, loaded.max_length)
    cosines, agree, total = [], 0, 0
    for table, width in tables_for_check([len(t) for t in texts]):
        batch = runner.forward(texts, table, width, outputs=(name,))
        rows, reference = batch.rows, batch.outputs[name]
        graph = session(rows)[name]
        present = rows["example_index"] >= 0
        a, b = reference[present], graph[present]
        cosines += list(
            (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)
        )
        if task == "classification":
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += len(a)
    figures = {"min_cosine_to_torch": round(float(min(cosines)), 6)}
    if total:
        figures["label_agreement"] = round(agree / total, 4)
    if dtype == "float32" and min(cosines) < FP32_MIN_COSINE:
        raise ExampleError(
            f"the exported graph differs from the torch model (min cosine {min(cosines):.6f} < {FP32_MIN_COSINE}); "
            "nothing was written"
        )
    return figures


def save_openvino_graph(
    model, loaded, trace_rows: dict, dtype: str, folder: Path, calibration
) -> tuple[str, list[str]]:
    """The packed model converted for OpenVINO (inference.openvino_graphs, rows and width open;
    its conversion cache used) and saved as an IR in `folder` -> (graph file, files written).
    Weights stay f32 in the IR (bfloat16 is the precision the CPU plugin is asked for); int8:
    NNCF's static quantization calibrated here, once, on the packed rows of `calibration`'s
    texts batched as `packed embed` batches them (inference.embedding.calibrate), never on a
    user's first call."""
    import openvino
    import torch

    from packed_transformers.inference.openvino_graphs import OpenVinoGraphs
    from packed_transformers.inference.openvino_session import signal_stack_kept

    if dtype == "int8":
        from packed_transformers.inference.embedding import calibrate
        from packed_transformers.inference.options import InferenceOptions
        from packed_transformers.inference.runner import Runner

        runner = Runner(model, "cpu", "int8", runtime="openvino")
        calibrate(runner, loaded, [], InferenceOptions.for_embedding(runtime="openvino", dtype="int8",
                                                                      calibration_texts=tuple(calibration)))  # fmt: skip
        converted = runner.backend.converted
    else:
        graphs = OpenVinoGraphs(model, dtype, torch.get_num_threads())
        graphs.convert(trace_rows)
        converted = graphs.converted
    with signal_stack_kept():
        openvino.save_model(converted, str(folder / "model.xml"), compress_to_fp16=False)
    return "model.xml", ["model.xml", "model.bin"]


def calibration_texts(path: Path | None) -> tuple[list[str], str]:
    """The texts an OpenVINO int8 export is calibrated on, and where they came from: the
    texts of `path` (JSON lines `{"text": ...}`, read as `packed embed` reads its input; at most
    CALIBRATION_TEXTS of them by a fixed sample), else a fixed sample of CALIBRATION_TEXTS of
    the installed BBC corpus's mixed texts (`packed assets install`). ExampleError (one line)
    for a file that is not such lines, or no file and no corpus."""
    from packed_transformers.inference.openvino_graphs import (
        CALIBRATION_TEXTS,
        MIN_CALIBRATION_TEXTS,
        calibration_picks,
    )

    if path is not None:
        from packed_transformers.commands.embed import read_texts

        texts, source = list(read_texts(Path(path), "text")), str(path)
    else:
        try:
            from packed_transformers.data.assets import corpus_glob
            from packed_transformers.data.embedding_texts import bbc_articles, texts_of

            texts = texts_of(bbc_articles(corpus_glob()), "mixed")
        except (ImportError, OSError, ExampleError) as err:
            raise ExampleError(
                f'--dtype int8 calibrates on texts like yours: give --calibration FILE (JSON lines with "text"), '
                f"or install the BBC corpus it uses otherwise (packed assets install; {str(err)[:80]})"
            ) from None
        source = "the installed BBC corpus (mixed texts)"
    if len(texts) < MIN_CALIBRATION_TEXTS:
        raise ExampleError(f"--calibration {path}: {len(texts)} texts; int8 calibrates on at least "
                           f"{MIN_CALIBRATION_TEXTS} (best: {CALIBRATION_TEXTS} like the ones to come)")  # fmt: skip
    return [texts[i] for i in calibration_picks(len(texts))], source


def export(args) -> dict:
    """Write the export folder; -> the summary."""
    import torch

    from packed_transformers.door.export_checks import recorded_files
    from packed_transformers.door.opener import AsTheFolderSays, ForEmbedding, open_folder
    from packed_transformers.inference.onnx_graphs import GRAPH_FILE, export_graph
    from packed_transformers.packs.rows import pack_rows

    describe = (
        ForEmbedding(args.pooling, args.normalize, args.max_length) if args.pooling or args.embedding
        else AsTheFolderSays()
    )  # fmt: skip
    loaded = open_folder(args.model, describe)
    task = loaded.spec.task
    if task not in GRAPH_TASKS:
        raise ExampleError(
            f"--model {args.model}: a {task} folder; packed export writes {' and '.join(GRAPH_TASKS)} folders"
        )
    model = loaded.model.eval()
    calibration, calibrated_on = [], None
    if args.runtime == "openvino" and args.dtype == "int8":
        if task != "embedding":
            raise ExampleError(f"--model {args.model}: a {task} folder; --runtime openvino --dtype int8 exports "
                               "embedding models (a classifier: --runtime onnxruntime --dtype int8)")  # fmt: skip
        calibration, calibrated_on = calibration_texts(args.calibration)
    texts = check_rows(model.config.vocab_size, loaded.max_length)
    table, width = tables_for_check([len(t) for t in texts])[1]
    trace_rows = pack_rows(texts, table, width)
    dimension = (
        loaded.dimension if task == "embedding" else len(loaded.spec.labels) or model.config.num_labels
    )
    with atomic_folder(args.output) as folder:
        if args.runtime == "openvino":
            graph_file, written = save_openvino_graph(
                model, loaded, trace_rows, args.dtype, folder, calibration
            )
            outputs = ["embeddings" if task == "embedding" else "logits"]
        else:
            outputs = export_graph(model, trace_rows, args.dtype, folder / GRAPH_FILE)
            graph_file, written = GRAPH_FILE, [GRAPH_FILE]
        figures = compare(model, loaded, folder / graph_file, args.runtime, args.dtype, task)
        tokenizer = loaded.tokenizer
        text = tokenizer.to_str() if hasattr(tokenizer, "to_str") else tokenizer._tokenizer.to_str()
        (folder / "tokenizer.json").write_text(text, encoding="utf-8")
        if loaded.vocab is not None:  # finetune.train's WordPiece folders tokenize pairs by it
            words = sorted(loaded.vocab, key=loaded.vocab.get)
            (folder / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
        info = ExportInfo(
            format=EXPORT_FORMAT, runtime=args.runtime, dtype=args.dtype, graph=graph_file, outputs=tuple(outputs),
            dimension=int(dimension), hidden_size=int(model.config.hidden_size),
            parameters=sum(p.numel() for p in model.parameters()),
            max_input_length=int(loaded.max_length), token_types=bool(loaded.token_types),
            spec=spec_fields(loaded.spec),
            source={"folder": str(Path(args.model).resolve()), "fingerprint": model_fingerprint(args.model),
                    "torch": torch.__version__},
            # each file's size and sha256: a copy cut short or a swapped file is refused at load
            files=recorded_files(folder, [*written, "tokenizer.json", *(["vocab.txt"] * (loaded.vocab is not None))]),
        )  # fmt: skip
        (folder / EXPORTED).write_text(json.dumps(info.to_json(), indent=1) + "\n", encoding="utf-8")
    size = sum(p.stat().st_size for p in Path(args.output).iterdir())
    return {"output": str(args.output), "task": task, "runtime": args.runtime, "dtype": args.dtype,
            "dimension": int(dimension), "megabytes": round(size / 2**20, 1), **figures,
            **({"calibrated_on": f"{len(calibration)} texts of {calibrated_on}"} if calibration else {})}  # fmt: skip


def runtime_problem(runtime: str, dtype: str) -> str | None:
    """The one line refusing an export this install or CPU cannot make (and check), or None."""
    if dtype not in EXPORT_DTYPES_OF[runtime]:
        others = [name for name, dtypes in EXPORT_DTYPES_OF.items() if dtype in dtypes]
        return (f"--runtime {runtime} exports {' or '.join(EXPORT_DTYPES_OF[runtime])}, not {dtype}"
                + (f" (--runtime {others[0]} --dtype {dtype} does)" if others else ""))  # fmt: skip
    if runtime == "openvino":
        from packed_transformers.inference.openvino_graphs import openvino_problem

        return openvino_problem("cpu", dtype)
    return onnxruntime_problem("cpu", dtype)


def main(argv=None) -> int:
    args = export_parser(__doc__).parse_args(argv)
    wrong = runtime_problem(args.runtime, args.dtype)
    if not wrong and args.calibration is not None and (args.runtime, args.dtype) != ("openvino", "int8"):
        wrong = "--calibration: only --runtime openvino --dtype int8 is calibrated (ONNX Runtime's int8 is dynamic)"
    if not wrong and args.calibration is not None and not Path(args.calibration).is_file():
        wrong = f"--calibration {args.calibration}: file not found"
    if not wrong and is_exported(args.model):  # its graph is made: there is no model to export again
        wrong = (f"--model {args.model}: is an exported folder ({EXPORTED}); export the model folder it was "
                 "made from (its packed_export.json names it under source.folder)")  # fmt: skip
    if not wrong and Path(args.output).resolve() == Path(args.model).resolve():
        wrong = f"--output {args.output}: is the model folder; give a new folder"
    # a folder output: an earlier export (its packed_export.json) is replaced, nothing else is
    wrong = wrong or output_folder_mistake(Path(args.output), [Path(args.model)], EXPORTED)
    if not wrong and Path(args.output).exists() and not args.overwrite:
        wrong = f"--output {args.output}: exists; give --overwrite to replace it, or another path"
    if not wrong:
        try:  # two exports into one folder: the second is refused, not both renamed in
            lock_folder(args.output, "packed export writing this folder")
        except FolderInUse as err:
            wrong = str(err)
    if wrong:
        return refuse(wrong)
    from packed_transformers.model.hf_checkpoint import quiet_transformers

    quiet_transformers(args.verbose)
    from packed_transformers.door.folder_spec import NoHead

    try:
        summary = export(args)
    except NoHead as err:  # predict's own words would send an exporting user to predict
        return refuse(f"{err.config_path}: key 'architectures' is {err.architectures}; packed export writes a "
                      "*ForSequenceClassification folder, or a bare encoder as an embedding model with --pooling MODE")  # fmt: skip
    except ExampleError as err:
        return refuse(err)
    except OSError as err:
        # a write failed in the temporary folder, whose name means nothing to the user: the
        # output is named; a model file that could not be read is named itself
        read = err.filename is not None and Path(str(err.filename)).resolve().is_relative_to(
            Path(args.model).resolve()
        )
        return refuse(
            describe_os_error(err, None if read else f"--output {args.output} (nothing was written)")
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    from packed_transformers.common.cli import run_main, sigterm_as_interrupt

    sigterm_as_interrupt()  # SIGTERM left the temporary folder (87 MB for MiniLM) behind
    sys.exit(run_main(main, "stopped; nothing was written (the folder appears only when complete)"))
