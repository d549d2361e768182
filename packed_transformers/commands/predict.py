"""Inference with any batching mode; predictions come back in input order.

    python -m packed_transformers.finetune.predict --model runs/bbc_packed/model --input texts.jsonl \
        --output predictions.jsonl [--batching packed] [--batch-size 64]

--model is a folder written by `python -m packed_transformers.finetune.train` (Hugging Face weights +
vocab.txt + finetune.json). --input is JSON lines with the text (and optional text pair)
fields the model was trained with; labels, when present, are scored. Any text is taken
up to the model's maximum length (its position embeddings; longer ones are truncated and
counted): rows and packs widen to the longest input when it exceeds the training length. Each output line is
{"index": i, "label": name, "scores": {name: score, ...}} (multi-label: "labels": [names]) for the i-th
input line, in input order whatever the batching (packs hold examples out of order; the
example indices put them back).

Classification through OpenVINO: `--runtime openvino` (float32, or with `--dtype int8` int8
calibrated on a fixed sample of up to 300 of the input's texts), a graph compiled per row
shape (inference/openvino_graphs.py); not with --ray or --compile, nor for other tasks.

Question answering (a folder written with data.task: question_answering): --input is
SQuAD JSON or its JSON lines; every question is answered once, with the window length,
doc_stride, n_best_size, max_answer_length and v2.0 settings the model was trained with
(finetune.json). --output is SQuAD's predictions file {question id: answer text};
--nbest-output adds the n-best file; gold answers, when present, are scored (EM / F1).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # option and path mistakes answered before torch is imported
    from packed_transformers.commands.parsers import predict_parser
    from packed_transformers.common.preflight import exit_on_path_mistakes, value_of

    early = predict_parser(__doc__).parse_args()  # --help, a mistyped or missing option: exits here

    ray = value_of(sys.argv[1:], "--ray") is not None  # --input may then be a folder or a glob
    exit_on_path_mistakes({"--model": "folder", "--input": "inputs" if ray else "json"})
    from packed_transformers.inference.runtime_choice import exit_on_machine_refusal

    exit_on_machine_refusal(early, ray)  # int8 without VNNI, bf16 without its instructions: no torch yet
    from packed_transformers.door.folder_spec import (
        predict_folder_mistake,
    )  # no torch: config.json's head, read as JSON

    model_option = value_of(sys.argv[1:], "--model")
    mistake = model_option and predict_folder_mistake(model_option)
    if mistake:
        print(f"error: {mistake}", file=sys.stderr)
        sys.exit(2)

import json
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np

from packed_transformers.commands.kept_predictions import write_kept_predictions
from packed_transformers.commands.parsers import predict_parser
from packed_transformers.common.cli import below_one, refuse
from packed_transformers.common.files import (
    FolderInUse,
    describe_os_error,
    output_over_inputs,
    write_json_atomic,
)
from packed_transformers.data.classification_data import ExampleError, encode_labels, read_jsonl
from packed_transformers.data.tokenizer import DataInputError
from packed_transformers.door.exported_folder import is_exported, settle_exported_arguments
from packed_transformers.door.opener import classification_fields, open_folder
from packed_transformers.inference.classify import plan_classification
from packed_transformers.inference.options import InferenceOptions
from packed_transformers.inference.predictions import score
from packed_transformers.inference.runner import Runner, runner_of, runtime_problem
from packed_transformers.inference.runtime_choice import resolved_runtime
from packed_transformers.packs.errors import PackingInputError


def undertrained_note(model) -> str | None:
    """What the fine-tuning run that wrote `model` says of an early end (its summary.json, beside
    the model folder finetune.train wrote: "stopped by training.max_seconds ..."), or None."""
    summary = Path(model).parent / "summary.json"
    if not (Path(model) / "finetune.json").is_file() or not summary.is_file():
        return None
    try:
        return json.loads(summary.read_text(encoding="utf-8")).get("undertrained")
    except (OSError, ValueError, AttributeError):  # not ours to judge: predict runs on
        return None


def main(argv=None) -> int:
    parser = predict_parser(__doc__)
    args = parser.parse_args(argv)
    wrong = below_one(
        args,
        (
            "batch_size",
            "max_sequences_per_pack",
            "pack_length",
            "workers",
            "threads_per_worker",
            "chunk_rows",
            "chunk_texts",
        ),
    )
    if not wrong and not args.chunk_seconds >= 0:  # NaN too
        wrong = f"--chunk-seconds must be 0 (chunks of --chunk-texts) or more, got {args.chunk_seconds}"
    exported = is_exported(args.model)
    if exported:  # its graph decides runtime and dtype: torch is never imported
        wrong = wrong or settle_exported_arguments(args, sys.argv[1:] if argv is None else argv, "predict")
    else:
        from packed_transformers.model.hf_checkpoint import quiet_transformers

        quiet_transformers(args.verbose)  # runtime_problem holds torch's device and dtype rules too
        wrong = wrong or runtime_problem(args.runtime, args.device, args.dtype, bool(args.ray), args.compile)
    if wrong:
        return refuse(wrong)
    note = undertrained_note(args.model)
    if note:  # the run's own word, before predictions a user might trust
        print(f"warning: --model {args.model}: {note}", file=sys.stderr)
    if args.ray:
        args.runtime = "torch"  # the Ray replicas run torch (auto's choice there; openvino is refused above)
        return run_on_ray(args)
    summary_path = args.output.with_suffix(".summary.json")
    outputs = [args.output, summary_path] + ([args.nbest_output] if args.nbest_output else [])
    for output in outputs:  # an output never replaces an input, nor lands in the model folder
        clash = output_over_inputs(output, [args.input], [args.model])
        if clash:
            return refuse(clash)
        if output.exists() and not args.overwrite:  # one rule with embed and export: nothing replaced unasked
            return refuse(f"--output {output}: exists; give --overwrite to replace it, or another path")
    try:
        # Before any compute: an unwritable output would otherwise lose a finished inference.
        for output in outputs:
            output.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(output.parent, os.W_OK):
                raise PermissionError(13, "Permission denied (cannot write here)", str(output.parent))
    except OSError as err:
        return refuse(describe_os_error(err))
    try:
        # the input's mistakes before the model loads, where the folder says its fields without loading
        known = classification_fields(args.model)
        early = (
            read_jsonl(args.input, known.text, known.pair, known.label, need_labels=False) if known else None
        )
        folder = open_folder(args.model)
        model, spec = folder.model, folder.spec
        if not exported:
            chosen = resolved_runtime(args.runtime, spec.task, args.device, args.dtype, compiled=args.compile)
            if chosen.why:
                print(chosen.why, file=sys.stderr)
            args.runtime = chosen.runtime
        if args.runtime != "torch" and spec.task != "classification" and not exported:
            return refuse(f"--runtime {args.runtime} runs classification folders (and embed); {args.model} is "
                          f"a {spec.task} folder: leave --runtime out")  # fmt: skip
        if spec.task == "question_answering":
            return predict_answers(args, folder, summary_path)
        if spec.task == "token_classification":
            return predict_tags(args, folder, summary_path)
        fields = spec.fields
        examples = (
            early
            if early is not None and known == fields
            else read_jsonl(args.input, fields.text, fields.pair, fields.label, need_labels=False)
        )
        has_labels = all(label is not None for label in examples.labels)
        labels = (
            encode_labels(examples, list(spec.labels), spec.multi_label)
            if has_labels
            else np.zeros(len(examples), dtype=np.int64)
        )
        runner = (
            runner_of(folder, args.device, args.dtype, args.compile, args.runtime) if exported
            else Runner(model, args.device, args.dtype, compiled=args.compile, runtime=args.runtime)
        )  # fmt: skip
        options = InferenceOptions.from_args(args)
        plan = plan_classification(folder, runner, examples, labels, options)
        logits, timing, kept = write_kept_predictions(args, runner, plan, options, list(spec.labels),
                                                      spec.multi_label)  # fmt: skip
    except (ExampleError, DataInputError, PackingInputError, FolderInUse) as err:
        return refuse(err)
    except OSError as err:
        return refuse(describe_os_error(err))
    report = {"batching": args.batching, "dtype": args.dtype, "runtime": args.runtime, **timing,
              "padding_fraction": runner.stats.padding_fraction, "truncated": plan.data.truncated,
              # a continued run: the rows an interrupted one kept (not timed here)
              **({"kept_from_earlier_run": kept} if kept else {})}  # fmt: skip
    if has_labels:
        report.update(score(logits, labels, spec.multi_label))
    return write_outputs(lambda: None, summary_path, report)  # the predictions are in place already


def run_on_ray(args) -> int:
    """--ray: the whole input on a Ray cluster (ray_jobs/job.py), Parquet shards out.
    The folder is loaded here first, so that a folder that cannot run is one line before
    any cluster starts."""
    from packed_transformers.ray_jobs.job import run_job

    if args.device != "cpu":
        print(
            "error: --ray runs replicas on CPUs; give --device cpu (or run without --ray on the GPU)",
            file=sys.stderr,
        )
        return 2
    try:
        spec = open_folder(args.model).spec
        if spec.task != "classification":
            raise ExampleError(
                f"{args.model}: a {spec.task} folder; --ray runs sequence classification (run this one without --ray)"
            )
    except ExampleError as err:
        return refuse(err)
    # what each replica is given: the batching and precision (a replica runs on its own CPU)
    options = {key: value for key, value in asdict(InferenceOptions.from_args(args)).items()
               if key in REPLICA_OPTIONS}  # fmt: skip
    described = {"labels": list(spec.labels), "multi_label": spec.multi_label}
    return run_job(args, "predict", options, spec.fields.text, spec.fields.pair, described)


REPLICA_OPTIONS = (
    "batching",
    "batch_size",
    "max_sequences_per_pack",
    "algorithm",
    "pack_length",
    "dtype",
    "compile",
)


def predict_tags(args, folder, summary_path: Path) -> int:
    """Token classification: JSON lines {"text"} -> one line per input {"index", "entities"}
    (transformers' token-classification pipeline's dicts, aggregation "none")."""
    from packed_transformers.data.classification_data import read_jsonl
    from packed_transformers.inference.runner import per_sequence_tokens
    from packed_transformers.inference.token_task import entities, tokenize_for_tags

    examples = read_jsonl(args.input, folder.spec.fields.text, None, None, need_labels=False)
    limit = folder.max_length
    tagged = tokenize_for_tags(examples.texts, examples.where, folder.tokenizer, limit)
    lengths = np.array([len(t) for t in tagged.token_ids])
    width = int(lengths.max())
    batcher = InferenceOptions.from_args(args).batcher(lengths, width, width)
    runner = Runner(folder.model, args.device, args.dtype, compiled=args.compile)
    tables = batcher.epoch(0, shuffle=False)
    batches = list(runner.run(tagged.token_ids, tables, batcher.width, tagged.segment_ids, ("logits",)))
    logits = per_sequence_tokens(batches, "logits", lengths)
    labels = list(folder.spec.labels)
    records = [{"index": i, "entities": entities(logits[i], tagged, i, labels)} for i in range(len(lengths))]
    report = {
        "task": "token_classification", "batching": args.batching, "examples": len(lengths),
        "seconds": runner.stats.seconds, "batches": runner.stats.batches,
        "padding_fraction": runner.stats.padding_fraction, "truncated": tagged.truncated,
    }  # fmt: skip

    def write():
        from packed_transformers.common.files import atomic_path

        args.output.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(args.output) as tmp, tmp.open("w") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")

    return write_outputs(write, summary_path, report)


def predict_answers(args, folder, summary_path: Path) -> int:
    """Question answering: SQuAD questions -> windows -> batches -> answers, files."""
    from packed_transformers.data.qa_data import read_squad
    from packed_transformers.data.qa_windows import make_windows
    from packed_transformers.inference.question_answering import (
        QaSplit,
        answer_questions,
        answer_settings,
        score_answers,
        write_answer_files,
    )

    model, spec = folder.model, folder.spec
    qa = spec.qa
    examples = read_squad(args.input)
    width = spec.max_sequence_length
    windows = make_windows(examples, folder.hf_tokenizer(), width, qa["doc_stride"])
    pack_length = args.pack_length or spec.pack_length or width
    if pack_length < width:
        raise ExampleError(
            f"--pack-length {pack_length} is shorter than the model's windows ({width} tokens)"
        )
    settings = answer_settings(qa, keep_nbest=args.nbest_output is not None)
    batcher = InferenceOptions.from_args(args).batcher(windows.lengths, width, pack_length)
    runner = Runner(model, args.device, args.dtype, compiled=args.compile)
    answers, timing = answer_questions(runner, QaSplit(examples, windows), batcher, settings)
    report = {"task": "question_answering", "batching": args.batching, **timing}
    if examples.has_answers:
        report.update(score_answers(answers, examples, qa["version_2_with_negative"]))
    return write_outputs(
        lambda: write_answer_files(args.output, answers, examples, args.nbest_output), summary_path, report
    )


def write_outputs(write, summary_path: Path, report: dict) -> int:
    """`write()` the predictions, then the summary; print the report. -> the exit code (2,
    with one line, when the disk refuses)."""
    try:
        write()
        write_json_atomic(summary_path, report)
    except OSError as err:
        return refuse(describe_os_error(err))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    from packed_transformers.common.cli import run_main, sigterm_as_interrupt

    sigterm_as_interrupt()  # SIGTERM ends as Ctrl-C does: the predictions written are kept
    sys.exit(run_main(main, "stopped before any prediction was kept; nothing was written"))
