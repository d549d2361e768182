"""training.compile against eager: the packed training step compiled once (issue 70, deliver 3).

    python bench/bench_compile_train.py [--cases classify sft] [--steps 40] [--threads 2]

Each (case, way) runs in a fresh process (inductor's caches cold, as a user's first run)
through fine-tuning's own run: finetune.train.Run sets up the job, the batcher and
the step model, and finetune_step trains --steps batches. Per step the wall time is kept.

  classify  configs/finetune_bbc.yaml as shipped: MiniLM-L6 (the asset), BBC News, packed
            rows of 72 tokens, 32 examples a step
  sft       a random Llama of hidden 512, 4 layers (bench_sft's small shape) fine-tuned on
            BBC headline pairs (bench_sft's data and byte-level BPE), packed rows of 1,024
            tokens, 8 examples a step

Ways: `eager`; `compiled` (training.compile: true, inductor, static shapes, one graph);
for classify also `dynamic-compiled`: batching.mode dynamic (each batch padded to its
longest example, as length-grouped or padding-free peers shape their batches) under
torch.compile with dynamic=None (torch's default: a recompile on the first new width,
then shape-generic graphs) — what compiling costs where shapes change.

Reported per way: the first step (the compiling is paid there), the median of the later
steps, the graphs compiled, and for compiled against eager the crossover: the steps after
which the compiled run has caught up (compile seconds / seconds saved per step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORKER = r"""
import dataclasses, json, sys, time, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(int(sys.argv[5]))
from packed_transformers.finetune import train as finetune
from packed_transformers.finetune.config import load_finetune_config
from packed_transformers.model.hf_checkpoint import quiet_transformers
quiet_transformers()
config_path, way, steps = sys.argv[2], sys.argv[3], int(sys.argv[4])
sets = ["training.progress=false", "training.epochs=50", *json.loads(sys.argv[6])]
if way == "compiled":
    sets.append("training.compile=true")
if way == "dynamic-compiled":
    sets.append("batching.mode=dynamic")
config = load_finetune_config(config_path, sets)
scratch = tempfile.TemporaryDirectory()  # the run folder, removed when this process ends
run = finetune.Run(config, Path(scratch.name) / "run", False)
engine = run.engine.torch_step
if way == "dynamic-compiled":
    engine = dataclasses.replace(engine, step_model=torch.compile(run.model))
seconds, shapes, epoch = [], set(), 0
while len(seconds) < steps:
    for table in run.batcher.epoch(epoch):
        if len(seconds) == steps:
            break
        batch = run.job.collate(run.job.train, table, run.batcher.width(table))
        shapes.add(tuple(batch["input_ids"].shape))
        started = time.perf_counter()
        finetune.finetune_step(engine, batch, run.schedule(len(seconds)), run.job.loss)
        seconds.append(time.perf_counter() - started)
    epoch += 1
graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
print(json.dumps({"seconds": seconds, "graphs": graphs, "shapes": len(shapes)}))
"""


def sft_config(folder: Path) -> Path:
    """bench_sft's data (BBC headline pairs, its byte-level BPE) and small random Llama, as a
    fine-tuning config of packed rows of 1,024 tokens."""
    import transformers
    import yaml

    from bench.bench_sft import SHAPES, bpe_tokenizer, headline_pairs

    pairs = headline_pairs(1500)
    tokenizer = bpe_tokenizer([p["prompt"] + p["completion"] for p in pairs])
    start = folder / "start"
    config = transformers.AutoConfig.for_model(
        "llama", **SHAPES["small"], vocab_size=len(tokenizer), pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(start)
    tokenizer.save_pretrained(start)
    train = folder / "train.jsonl"
    train.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    path = folder / "sft.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"init_checkpoint": str(start), "hidden_dropout": 0.0, "attention_dropout": 0.0},
                "data": {"task": "causal_lm", "train_file": str(train), "validation_fraction": 0.05,
                         "max_sequence_length": 1024},
                "batching": {"mode": "packed", "batch_size": 8, "pack_length": 1024, "max_sequences_per_pack": 8},
                "optim": {"lr": 1e-4, "weight_decay": 0.0},
            }
        )
    )  # fmt: skip
    return path


def run_way(config: Path, way: str, steps: int, threads: int, sets: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(REPO), str(config), way, str(steps), str(threads), json.dumps(sets)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{way} on {config} failed:\n{done.stderr[-3000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    later = figures["seconds"][2:]
    figures["first"] = figures["seconds"][0]
    figures["median"] = statistics.median(later)
    return figures


def main() -> int:
    from bench.machine import description, line

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=("classify", "sft"), default=["classify", "sft"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a config override for every case (model.attention_backend=sdpa, ...)",
    )
    parser.add_argument(
        "--ways",
        nargs="+",
        choices=("eager", "compiled", "dynamic-compiled"),
        default=["eager", "compiled", "dynamic-compiled"],
    )
    args = parser.parse_args()
    machine = description()
    print(line(machine))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        configs = {"classify": REPO / "configs" / "finetune_bbc.yaml"}
        if "sft" in args.cases:
            configs["sft"] = sft_config(Path(tmp))
        for case in args.cases:
            ways = [w for w in args.ways if w != "dynamic-compiled" or case == "classify"]
            results[case] = {
                way: run_way(configs[case], way, args.steps, args.threads, args.set) for way in ways
            }
    print("\n| case | way | first step s | later steps, median s | graphs | batch shapes | vs eager (later steps) |"
          " crossover |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for case, ways in results.items():
        eager = ways.get("eager")
        for way, figures in ways.items():
            ratio = f"{eager['median'] / figures['median']:.2f}x" if eager else "-"
            crossover = "-"
            if way != "eager" and eager:
                extra = figures["first"] - eager["first"]
                saved = eager["median"] - figures["median"]
                crossover = f"{extra / saved:.0f} steps" if saved > 0 else "never (no step is faster)"
            print(f"| {case} | {way} | {figures['first']:.2f} | {figures['median']:.3f} | {figures['graphs']} | "
                  f"{figures['shapes']} | {ratio} | {crossover} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
