"""Where a whole `commands.embed` or `commands.predict` run spends its time, end to end: the
interpreter and imports, loading the folder, reading the input, tokenizing, planning packs,
building rows and masks, the forward (by operator class), putting outputs back in input
order, writing; each measured inside one real run of the command's `main`.

    python bench/profile_commands.py --command embed --model FOLDER --input TEXTS.jsonl [--threads 2]
    python bench/profile_commands.py --command predict --model FOLDER --input TEXTS.jsonl

Each stage is the wall time spent inside the functions that do it (wrapped with timers for the
run; tokenizing runs in a second thread beside the forward, so the stages may sum to more
than the run). Imports are timed in a fresh interpreter (`python -c "import commands.embed"`),
so they are the cost a command pays before its first line of work. The forward's operator
classes come from torch.profiler over a second pass of the same batches (top-level operators:
linear and matmul, attention, layer norm, activation, elementwise, copies and indexing).
Results: one JSON object on stdout (and --output).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# torch.profiler's top-level CPU operator names -> the class they are counted in
OPERATOR_CLASSES = [
    ("attention", ("scaled_dot_product", "attention", "softmax", "baddbmm", "bmm")),
    ("linear/matmul", ("linear", "addmm", "matmul", "aten::mm")),
    ("layer norm", ("layer_norm",)),
    ("activation", ("gelu", "silu", "tanh", "relu")),
    (
        "copies/indexing",
        ("copy", "index", "cat", "embedding", "to", "contiguous", "gather", "where", "masked", "select"),
    ),
]


def operator_class(name: str) -> str:
    lowered = name.lower()
    for label, needles in OPERATOR_CLASSES:
        if any(needle in lowered for needle in needles):
            return label
    return "elementwise/other"


def import_seconds(module: str, repeats: int = 3) -> dict:
    """A fresh interpreter's start-up, and its start-up plus `import module` (best of `repeats`)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def best(code: str) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
            times.append(time.perf_counter() - started)
        return min(times)

    bare = best("pass")
    return {"interpreter": round(bare, 3), "imports": round(best(f"import {module}") - bare, 3)}


class StageClock:
    """Wall seconds per stage, from functions wrapped with `wrap` (a generator is timed while
    it produces each item)."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)

    def wrap(self, stage: str, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[stage] += time.perf_counter() - started

        return timed

    def wrap_generator(self, stage: str, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            iterator = function(*args, **kwargs)
            while True:
                started = time.perf_counter()
                try:
                    item = next(iterator)
                except StopIteration:
                    self.seconds[stage] += time.perf_counter() - started
                    return
                self.seconds[stage] += time.perf_counter() - started
                yield item

        return timed

    def patch(self, owner, name: str, stage: str, generator: bool = False):
        original = getattr(owner, name)
        setattr(owner, name, (self.wrap_generator if generator else self.wrap)(stage, original))
        return original


def forward_by_operator(model, batches: list[dict], dtype: str) -> dict:
    """Seconds by operator class, and of the ten costliest top-level operators, over one pass
    of the recorded batches (already warm), in the run's precision (inference.precision:
    bfloat16 under autocast)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from packed_transformers.inference.precision import precision

    with torch.inference_mode(), precision("cpu", dtype), profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for batch in batches:
            model(**batch)
        wall = time.perf_counter() - started
    by_class: dict[str, float] = collections.defaultdict(float)
    by_name: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.cpu_parent is not None:
            continue  # top-level operators only: their children are inside them
        by_class[operator_class(event.name)] += event.cpu_time_total / 1e6
        by_name[event.name] += event.cpu_time_total / 1e6
    return {
        "wall": round(wall, 3),
        "by_class": {k: round(v, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "top_operators": {k: round(v, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:10]},
    }


def profile_run(command: str, argv: list[str]) -> tuple[dict, float, list[dict], object]:
    """Run the command's main once with its stages wrapped -> (stage seconds, wall seconds,
    the batches the model ran, the model)."""
    import packed_transformers.door.loaded as loaded
    import packed_transformers.inference.embedding as embedding
    import packed_transformers.inference.runner as runner
    from packed_transformers.packs import batching

    clock = StageClock()
    recorded: list[dict] = []
    models: list = []
    restore = []

    def remember(owner, name, stage, generator=False):
        restore.append((owner, name, clock.patch(owner, name, stage, generator)))

    real_forward = runner.Runner.forward

    def forward(self, token_ids, table, width, segment_ids=None, outputs=("logits",)):
        rows = runner.pack_rows(token_ids, table, width, segment_ids)
        recorded.append({name: runner.torch.from_numpy(value) for name, value in rows.items()})
        if not models:
            models.append(self.model)
        return real_forward(self, token_ids, table, width, segment_ids, outputs)

    runner.Runner.forward = forward
    restore.append((runner.Runner, "forward", real_forward))
    remember(runner, "pack_rows", "rows and masks")
    remember(batching, "pack_examples", "planning packs")
    remember(embedding, "width_groups", "planning packs")
    remember(loaded.LoadedModel, "tokenize_texts", "tokenizing")
    remember(loaded.LoadedModel, "tokenize", "tokenizing")
    if command == "embed":
        import packed_transformers.commands.embed as module

        remember(module, "load_encoder", "loading the folder")
        remember(module, "read_texts", "reading the input", generator=True)
        remember(module, "count_lines", "reading the input")
        remember(embedding, "unpack_outputs", "back to input order")
        remember(embedding, "l2_normalize", "back to input order")
    else:
        import packed_transformers.commands.predict as module
        import packed_transformers.inference.classify as classify
        import packed_transformers.inference.predictions as inference

        remember(module, "load_finetuned", "loading the folder")
        remember(module, "read_jsonl", "reading the input")
        remember(module, "write_predictions", "writing")
        remember(classify, "width_groups", "planning packs")
        remember(inference, "per_sequence", "back to input order")
    # the model's own call, inside Runner.forward (read-back included: .cpu() waits for it)
    real_call = runner.precision

    def timed_precision(*args, **kwargs):
        return _TimedContext(real_call(*args, **kwargs), clock, "forward (model)")

    runner.precision = timed_precision
    restore.append((runner, "precision", real_call))
    try:
        started = time.perf_counter()
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            code = module.main(argv)
        wall = time.perf_counter() - started
    finally:
        for owner, name, original in reversed(restore):
            setattr(owner, name, original)
    if code != 0:
        raise SystemExit(f"the command failed (exit {code})")
    return dict(clock.seconds), wall, recorded, models[0]


class _TimedContext:
    def __init__(self, inner, clock: StageClock, stage: str):
        self.inner, self.clock, self.stage = inner, clock, stage

    def __enter__(self):
        self.started = time.perf_counter()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        result = self.inner.__exit__(*exc)
        self.clock.seconds[self.stage] += time.perf_counter() - self.started
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--command", choices=("embed", "predict"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--input", required=True, type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more options for the command")
    parser.add_argument("--output", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    startup = import_seconds(f"packed_transformers.finetune.{args.command}")
    with tempfile.TemporaryDirectory() as scratch:
        suffix = ".npy" if args.command == "embed" else ".jsonl"
        argv = ["--model", args.model, "--input", str(args.input), "--output", str(Path(scratch) / f"out{suffix}"),
                *(["--quiet"] if args.command == "embed" else []), *args.extra]  # fmt: skip
        stages, wall, batches, model = profile_run(args.command, argv)
    stages = {k: round(v, 3) for k, v in sorted(stages.items(), key=lambda kv: -kv[1])}
    measured = sum(v for k, v in stages.items() if k != "tokenizing")  # tokenizing overlaps the forward
    result = {
        "command": f"python bench/profile_commands.py {' '.join(sys.argv[1:])}",
        "date": time.strftime("%Y-%m-%d"),
        "threads": args.threads,
        "startup_seconds": startup,
        "run_seconds": round(wall, 3),
        "stages_seconds": stages,
        "rest_of_run_seconds": round(max(wall - measured, 0.0), 3),
        "forward_by_operator": forward_by_operator(
            model, batches, "bfloat16" if "bfloat16" in args.extra else "float32"
        ),
        "texts": sum(1 for line in args.input.open() if line.strip()),
    }
    print(json.dumps(result, indent=1))
    if args.output:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
