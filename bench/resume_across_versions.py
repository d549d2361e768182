"""Checkpoints written by another checkout resume here, exactly: a refactor's check that the
checkpoint format and the resume path still meet (issue 107: "Checkpoints written by 6002aac's
runs still resume").

    git worktree add /tmp/old 6002aac
    python bench/resume_across_versions.py --old /tmp/old [--jobs bert decoder multilabel]

For each job, three whole processes (PYTHONPATH set to their tree, as side_by_side_training.py
runs them):
1. the other tree trains the first part and leaves a checkpoint: BERT (configs/demo.yaml,
   synthetic packs) and the decoder (configs/pretrain_decoder_tiny.yaml on side_by_side's
   rows) stop at --steps steps, the end of a run; multi-label fine-tuning (side_by_side's
   short texts, 2 epochs) is killed (SIGKILL) once its first epoch's checkpoint is on disk;
2. this tree continues it with --resume to the whole run (BERT, decoder: 2 x --steps);
3. this tree runs the whole run uninterrupted.
Exact resume: the continued run took up the checkpoint (`resumed`: a new run to the same end
would match too), and its final weights (model.safetensors) and its last training loss
(pretraining) or validation figures (fine-tuning) equal the uninterrupted run's bit for bit.
Prints one JSON object; exit 1 where a job differs or a process fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from side_by_side_training import decoder_rows, short_multilabel  # noqa: E402

REPO = HERE.parent


def command(job: str, tree: Path, out: Path, steps: int, data: Path, resume: bool) -> list[str]:
    """The job's command in `tree` (the run `steps` steps long for the pretraining jobs)."""
    sets = {
        "bert": ["data.synthetic=true", "data.max_sequences_per_pack=3", "data.eval_dir=null", "logging.mlperf=false", "logging.progress=false",
                 "logging.tensorboard=false", "training.max_train_seconds=null", "eval.every_samples=1000000000",
                 "eval.at_end=false", f"training.max_steps={steps}"],
        "decoder": [f"data.train_dir={data}", "data.eval_dir=null", "data.max_sequence_length=2048",
                    "logging.tensorboard=false", "model.vocab_size=512", f"training.max_steps={steps}"],
        "multilabel": [f"data.train_file={data}", "data.multi_label=true", "data.max_sequence_length=32",
                       "batching.batch_size=8", "training.epochs=2", "training.progress=false"],
    }[job]  # fmt: skip
    extra = [a for s in sets for a in ("--set", s)] + (["--resume"] if resume else [])
    if job == "multilabel":
        return [sys.executable, "-m", "packed_transformers.finetune.train", "--config",
                str(tree / "configs" / "finetune_own.yaml"), "--output-dir", str(out), *extra]  # fmt: skip
    config = "configs/demo.yaml" if job == "bert" else "configs/pretrain_decoder_tiny.yaml"
    return [sys.executable, str(tree / "run_pretraining.py"), "--config", str(tree / config),
            "--output-dir", str(out), *extra]  # fmt: skip


def run(
    job: str, tree: Path, out: Path, steps: int, data: Path, resume: bool = False, kill_at_checkpoint=False
):
    """One process of `tree`; with kill_at_checkpoint, SIGKILL once a checkpoint folder exists
    (checkpoints appear by atomic rename: one that exists is whole)."""
    process = subprocess.Popen(command(job, tree, out, steps, data, resume), cwd=tree, env=dict(os.environ,
                               PYTHONPATH=str(tree)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    if kill_at_checkpoint:
        while process.poll() is None and not list((out / "checkpoints").glob("step-*")):
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.communicate()
        if not list((out / "checkpoints").glob("step-*")):
            raise RuntimeError(f"{tree} {job}: ended before its first checkpoint")
        return
    _, stderr = process.communicate()
    if process.returncode:
        raise RuntimeError(f"{tree} {job} (exit {process.returncode}): {stderr[-3000:]}")
    return stderr


def resumed(job: str, out: Path, stderr: str, steps: int) -> bool:
    """Whether the continuing process took up the checkpoint, not a new run to the same end
    (which would match the uninterrupted run as well): a pretraining run's metrics.jsonl holds
    each step once (a resume forgets the lines after its checkpoint; a new run would log steps
    1, 2, ... again after the first part's), the first part's last among them; fine-tuning's
    process says it resumed in epoch 1."""
    if job == "multilabel":
        return "resumed from" in stderr and "epoch 1, 0 batches done" in stderr
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [x["step"] for x in lines if x.get("kind") == "train"]
    return logged == sorted(set(logged)) and steps in logged and 2 * steps in logged


def outcome(job: str, out: Path) -> dict:
    """The run's final weights (sha256 of model.safetensors) and its figure of record."""
    if job == "multilabel":
        weights = out / "model" / "model.safetensors"
        summary = json.loads((out / "summary.json").read_text())
        figure = {
            k: v for k, v in summary.items() if k.startswith("validation_") and k != "validation_examples"
        }
    else:
        newest = max((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        weights = newest / "model" / "model.safetensors"
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        last = [x for x in lines if x.get("kind") == "train"][-1]
        figure = {"step": last["step"], "loss": last["loss"]}
    return {"weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(), "figure": figure}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="the checkout that writes the checkpoints")
    parser.add_argument("--jobs", nargs="+", default=["bert", "decoder", "multilabel"])
    parser.add_argument("--steps", type=int, default=20, help="the pretraining jobs' first part")
    parser.add_argument("--scratch", type=Path, default=Path("bench_out/resume_across_versions"))
    args = parser.parse_args()
    old, new, scratch = args.old.resolve(), REPO, args.scratch.resolve()
    subprocess.run(["rm", "-rf", str(scratch)], check=True)
    scratch.mkdir(parents=True)
    report, failed = {}, False
    for job in args.jobs:
        data = {"decoder": lambda: decoder_rows(scratch / "rows"),
                "multilabel": lambda: short_multilabel(scratch / "short.jsonl")}.get(job, lambda: scratch)()  # fmt: skip
        continued, whole = scratch / f"{job}_continued", scratch / f"{job}_whole"
        try:
            run(job, old, continued, args.steps, data, kill_at_checkpoint=job == "multilabel")
            stderr = run(job, new, continued, 2 * args.steps, data, resume=True)
            run(job, new, whole, 2 * args.steps, data)
        except RuntimeError as err:
            print(err, file=sys.stderr)
            return 1
        results = {"continued": outcome(job, continued), "whole": outcome(job, whole),
                   "resumed": resumed(job, continued, stderr, args.steps)}  # fmt: skip
        results["identical"] = results["continued"] == results["whole"]
        failed = failed or not (results["identical"] and results["resumed"])
        report[job] = results
    print(json.dumps({"old": str(old), "report": report}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
