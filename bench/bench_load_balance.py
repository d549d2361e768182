"""Load balance over data-parallel replicas: how long each replica waits at the gradient
all-reduce when its batch costs less than the other's (the packing paper's Figure 5 argument).

    python bench/bench_load_balance.py [--steps 10] [--examples-per-replica 8] [--row 1024]

Two processes (torchrun, gloo, one thread each on this 2-core machine) train the same random
Llama (4 layers x 256, byte vocabulary) on the same examples, BBC News articles cut at a random
5-100% of 1,000 bytes (lengths spread as instruction data's are), three ways:

  packed         this project's rows: every example of the run packed (LPFHP) into rows of
                 --row tokens; each replica takes the same number of rows a step (the few
                 rows that do not fill a last step are not trained)
  padding_free   each replica's examples flattened into one row (TRL's padding-free batches,
                 DataCollatorWithFlattening): its length is the sum of its examples'
  grouped        each replica's examples padded to the longest of its batch, one per row,
                 examples ordered as Trainer's group_by_length orders them (megabatches of 50
                 x the batch, sorted by length)

All three attend each example only to itself through the same packed model (length buckets),
so the step's arithmetic differs only by how the work is split. Per step and replica: compute
(forward + backward), then the wait: a one-element all-reduce issued right after backward
blocks until the slower replica arrives. Reported: mean wait per step (and its share of the
step), tokens/s of real tokens over both replicas.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def examples(count: int, seed: int = 0) -> list[np.ndarray]:
    """Byte token arrays of BBC articles cut at a random 5-100% of 1,000 bytes (ids 1..256)."""
    from packed_transformers.data.assets import corpus_files
    from packed_transformers.data.create_pretraining_data import read_document

    rng = np.random.default_rng(seed)
    out = []
    for path in sorted(corpus_files())[:count]:
        text, _ = read_document(path)
        data = np.frombuffer(" ".join(text.split()).encode()[: int(1000 * rng.uniform(0.05, 1.0))], np.uint8)
        out.append(data.astype(np.int64) + 1)
    return out


def grouped_order(lengths: np.ndarray, batch: int, seed: int) -> np.ndarray:
    """transformers' LengthGroupedSampler: a random order cut into megabatches of 50 x batch,
    each sorted by length, longest first."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    mega = 50 * batch
    return np.concatenate(
        [sorted(order[i : i + mega], key=lambda j: -lengths[j]) for i in range(0, len(order), mega)]
    )


def rows_of(token_lists, table, width):
    import torch

    from packed_transformers.packs.rows import pack_rows

    fields = pack_rows(token_lists, table, width)
    batch = {k: torch.from_numpy(fields[k]) for k in ("input_ids", "position_ids", "sequence_ids")}
    batch["segment_ids"] = torch.zeros_like(batch["input_ids"])
    return batch


def plan(mode: str, data, steps: int, per_replica: int, width: int, world: int):
    """[step][rank] -> (token lists, table [rows, K], row width) of that replica's batch."""
    from packed_transformers.packs.tokenized import pack_examples

    lengths = np.array([len(t) for t in data])
    used = steps * per_replica * world
    if mode == "packed":
        table = pack_examples(lengths[:used], width, None, "lpfhp", seed=0)
        per = len(table) // (steps * world)  # rows a replica a step; the few rows left over are not trained
        return [[(data, table[(s * world + r) * per : (s * world + r + 1) * per], width) for r in range(world)]
                for s in range(steps)]  # fmt: skip
    order = grouped_order(lengths[:used], per_replica * world, 0) if mode == "grouped" else np.arange(used)
    out = []
    for s in range(steps):
        ranks = []
        for r in range(world):
            picked = order[(s * world + r) * per_replica : (s * world + r + 1) * per_replica]
            if mode == "padding_free":
                ranks.append((data, picked[None, :], int(lengths[picked].sum())))
            else:
                ranks.append((data, picked[:, None], int(lengths[picked].max())))
        out.append(ranks)
    return out


def replica(args) -> None:
    """One torchrun process: every mode, its timings written by rank 0."""
    import torch
    import torch.distributed as dist

    from packed_transformers.model.families import next_token_targets
    from packed_transformers.training.decoder.config import SCHEMA
    from packed_transformers.training.decoder.model import build_decoder

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {section: {k: v.default for k, v in keys.items()} for section, keys in SCHEMA.items()}
    config["model"].update(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2)  # fmt: skip
    data = examples((args.steps + 1) * args.examples_per_replica * world)
    results = {}
    for mode in ("packed", "padding_free", "grouped"):
        model = build_decoder(config, 257, 4096, 257)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        waits, steps_s, tokens = [], [], 0
        for step, ranks in enumerate(
            plan(mode, data, args.steps + 1, args.examples_per_replica, args.row, world)
        ):
            token_lists, table, width = ranks[rank]
            batch = rows_of(token_lists, table, width)
            started = time.perf_counter()
            out = model(**batch, shift_labels=next_token_targets(batch["input_ids"], batch["sequence_ids"]))
            out["loss"].backward()
            computed = time.perf_counter()
            dist.all_reduce(torch.zeros(1))  # blocks until the slower replica has computed too
            waited = time.perf_counter()
            for name, p in model.named_parameters():
                if p.grad is None:
                    raise SystemExit(
                        f"rank {rank} mode {mode} step {step}: no gradient for {name}; batch {table.tolist()}"
                    )
                dist.all_reduce(p.grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            real = torch.tensor([float((batch["sequence_ids"] > 0).sum())])
            dist.all_reduce(real)
            if step > 0:  # the first step warms up
                waits.append(waited - computed)
                steps_s.append(time.perf_counter() - started)
                tokens += int(real)
        gathered = [None] * world
        dist.all_gather_object(gathered, {"wait": waits, "step": steps_s})
        if rank == 0:
            wait = np.mean([np.mean(g["wait"]) for g in gathered])
            step = np.mean(gathered[0]["step"])
            results[mode] = {"mean_wait_s": float(wait), "mean_step_s": float(step), "wait_share": float(wait / step),
                             "tokens_per_second": tokens / float(np.sum(gathered[0]["step"]))}  # fmt: skip
            print(mode, json.dumps(results[mode]), flush=True)
    if rank == 0:
        Path(args.result).write_text(json.dumps(results, indent=1) + "\n")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--examples-per-replica", type=int, default=8)
    parser.add_argument("--row", type=int, default=1024)
    parser.add_argument(
        "--out", type=Path, default=None, help="write the results (and the machine) as JSON here"
    )
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        replica(args)
        return 0
    import tempfile

    import machine

    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   __file__, "--steps", str(args.steps), "--examples-per-replica", str(args.examples_per_replica),
                   "--row", str(args.row), "--result", str(result)]  # fmt: skip
        subprocess.run(command, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        results = json.loads(result.read_text())
    info = machine.description()
    print("| batches | mean step s | mean wait at the all-reduce s | wait / step | tokens/s |")
    print("|---|---:|---:|---:|---:|")
    for mode, r in results.items():
        print(f"| {mode} | {r['mean_step_s']:.3f} | {r['mean_wait_s']:.3f} | {r['wait_share']:.1%} | "
              f"{r['tokens_per_second']:,.0f} |")  # fmt: skip
    print(machine.line(info))
    if args.out:
        args.out.write_text(
            json.dumps({"machine": info, "results": results, "command": " ".join(sys.argv)}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
