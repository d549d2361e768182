"""Sequence classification of new text, the core every way in runs: commands.predict's
command, each Ray replica (ray_jobs.actors.PackedPredictor) and the benches. How a
command batches travels as one `InferenceOptions` value: built from the command's options,
taken by the Python API, sent to Ray's actors as `dataclasses.asdict(options)`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from packed_transformers.data.classification_data import ExampleError, TokenizedExamples
from packed_transformers.inference.options import InferenceOptions
from packed_transformers.inference.predictions import predict_logits
from packed_transformers.inference.runner import Runner
from packed_transformers.packs.batching import width_groups


@dataclass(frozen=True)
class ClassifyPlan:
    """How a classification input is run: its tokenized examples, the row width, the pack
    length, and whether rows are grouped by width (a folder that names no pack length)."""

    data: TokenizedExamples
    width: int
    pack_length: int
    in_width_groups: bool


def classify_examples(folder, runner: Runner, examples, labels, options: InferenceOptions):
    """A classification folder's logits for `examples`, in input order: what predict
    writes, and what each Ray replica runs on its share (ray_jobs.actors).

    -> (logits float32 [n, C], timing, the TokenizedExamples run).
    ExampleError (one line) where --pack-length is shorter than the longest input."""
    plan = plan_classification(folder, runner, examples, labels, options)
    logits, timing = classify_part(runner, plan, plan.data, options)
    return logits, timing, plan.data


def plan_classification(folder, runner: Runner, examples, labels, options: InferenceOptions) -> ClassifyPlan:
    """Tokenize `examples` (every one: a chunked run packs chunks of them, but its widths, pack
    length and int8 calibration are the whole input's, as an unchunked run's) and calibrate a
    runner that needs it. ExampleError where --pack-length is shorter than the longest input."""
    spec = folder.spec
    # New text may be longer than anything seen in training: take it up to the folder's
    # limit (LoadedModel.max_length, the door's: the positions; a transformers folder: its
    # tokenizer's model_max_length too), truncating beyond (counted in the report), and widen
    # rows and packs to the longest input rather than refuse the file.
    data = folder.tokenize(examples, labels, folder.max_length, "truncate")
    longest = int(data.lengths.max())
    if options.pack_length is not None and options.pack_length < longest:
        raise ExampleError(
            f"--pack-length {options.pack_length} is shorter than the longest input ({longest} tokens); "
            f"give at least {longest}, or leave it out"
        )
    width = max(spec.max_sequence_length, longest)
    in_width_groups = (
        options.batching == "packed" and options.pack_length is None and spec.pack_length is None
    )
    plan = ClassifyPlan(data, width, max(spec.pack_length or width, longest), in_width_groups)
    if runner.needs_calibration:
        calibrate(runner, plan, options)
    return plan


def classify_part(runner: Runner, plan: ClassifyPlan, part: TokenizedExamples, options: InferenceOptions):
    """Logits [len(part), C] of `part` (the plan's examples or a run of them), in its order, and timing."""
    if plan.in_width_groups:
        return predict_in_width_groups(options, runner, part, plan.width)
    return predict_logits(runner, part, options.batcher(part.lengths, plan.width, plan.pack_length))


def iter_classify(
    runner: Runner, plan: ClassifyPlan, options: InferenceOptions, start: int = 0
) -> Iterator[tuple[np.ndarray, dict]]:
    """(logits [k, C], timing) of the plan's examples from `start` on, chunk after chunk in input
    order, each about options.chunk_seconds of work (inference.embedding.ChunkSizes, at most
    options.chunk_texts): a writer keeps predictions chunk by chunk, as embed keeps rows."""
    from packed_transformers.inference.embedding import ChunkSizes

    data, sizes = plan.data, ChunkSizes(options.chunk_texts, options.chunk_seconds)
    while start < len(data):
        stop = min(len(data), start + sizes.next_size())
        part = TokenizedExamples(data.token_ids[start:stop], data.segment_ids[start:stop],
                                 data.labels[start:stop], 0)  # fmt: skip
        began = time.perf_counter()
        logits, timing = classify_part(runner, plan, part, options)
        sizes.observe(stop - start, time.perf_counter() - began)
        yield logits, timing
        start = stop


def calibrate(runner, plan: ClassifyPlan, options: InferenceOptions):
    """OpenVINO int8's calibration (before the first forward): the packed rows of a fixed sample
    of up to CALIBRATION_TEXTS of the examples (texts like the ones to come), batched as the
    pass over them batches them, every row width among them."""
    from packed_transformers.inference.openvino_graphs import calibration_picks

    data = plan.data
    picks = calibration_picks(len(data))
    tokens, segments = [data.token_ids[i] for i in picks], [data.segment_ids[i] for i in picks]
    lengths = np.array([len(t) for t in tokens])
    if plan.in_width_groups:
        hidden = runner.model.config.hidden_size
        groups = width_groups(lengths, plan.width, options.max_sequences_per_pack, options.algorithm, hidden)
        passes = [(members, options.batcher(lengths[members], w, w)) for members, w in groups if len(members)]
    else:
        passes = [(np.arange(len(tokens)), options.batcher(lengths, plan.width, plan.pack_length))]
    rows = []
    for members, batcher in passes:
        rows += runner.calibration_rows([tokens[i] for i in members], batcher.epoch(0, shuffle=False), batcher.width,
                                        [segments[i] for i in members])  # fmt: skip
    runner.calibrate(rows)


def predict_in_width_groups(options: InferenceOptions, runner, data, longest: int):
    """Packed inference where the folder names no pack length (a transformers folder): the
    texts are packed in groups of row widths (packs.batching.width_groups: each text in
    the narrowest of 64 / 128 / 256 / 512 that holds it, groups merged where that is less
    work), not all in rows as wide as the model's maximum. -> (logits [n, C], timing)."""
    hidden = runner.model.config.hidden_size
    groups = width_groups(data.lengths, longest, options.max_sequences_per_pack, options.algorithm, hidden)
    stats = runner.stats
    real_before, rows_before = stats.real_tokens, stats.row_tokens  # this pass's share of the runner's counts
    logits, timing = None, {"examples": len(data), "seconds": 0.0, "batches": 0}
    for members, width in groups:
        part = TokenizedExamples([data.token_ids[i] for i in members], [data.segment_ids[i] for i in members],
                                 data.labels[members], 0)  # fmt: skip
        part_logits, part_timing = predict_logits(runner, part, options.batcher(part.lengths, width, width))
        if logits is None:
            logits = np.empty((len(data), part_logits.shape[1]), dtype=part_logits.dtype)
        logits[members] = part_logits
        timing["seconds"] += part_timing["seconds"]
        timing["batches"] += part_timing["batches"]
    timing["examples_per_second"] = len(data) / timing["seconds"]
    timing["padding_fraction"] = 1.0 - (stats.real_tokens - real_before) / (stats.row_tokens - rows_before)
    return logits, timing
