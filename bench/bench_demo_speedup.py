"""The demo's realized speed-up, measured side by side: packed and unpacked steps interleaved.

    python bench/bench_demo_speedup.py [--steps 60] [--config configs/demo.yaml] [--profile]

`make demo` trains the two runs one after the other; on a noisy machine their
sequences/s can drift by 10-20% between runs. Here both runs' engines (the demo config,
packed with its packing adjustment and over the unpacked baseline with none) live in one
process and alternate step by step, each step timed from fetching its micro-batches
(components.data.PackedShards, as the run's in-process loader does) through the LAMB
update (engines.torch_engine.TorchEngine.step: counts, forward, backward, checks,
optimizer). The ratio of total sequences per total seconds is the realized speed-up;
the goal is >= 0.95 x the packing factor.

--profile adds where the time goes, per sequence, by operator class: the costs that
scale with rows (dense layers over S positions, the vocabulary head over M slots) shrink
with packing; attention over each sequence's own tokens (the varlen backend, in both
runs) and the per-step optimizer do not.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from packed_transformers.components.data import PackedShards  # noqa: E402
from packed_transformers.engines.engine import PER_TOKEN  # noqa: E402
from packed_transformers.packing.shards import PackedDataset  # noqa: E402
from packed_transformers.training.build import build_model, packing_factor  # noqa: E402
from packed_transformers.training.config import load_config  # noqa: E402


class Side:
    """One run's engine, data and pack order."""

    def __init__(self, config_path: Path, sets: list[str], seed: int):
        from packed_transformers.engines.torch_engine import TorchEngine

        self.config = load_config(config_path, sets)
        dataset = PackedDataset.open(self.config["data"]["train_dir"])
        self.shards = PackedShards(dataset)
        self.packing_factor = packing_factor(dataset)
        self.engine = TorchEngine(self.config)
        self.arithmetic = self.engine.attach(build_model(self.config, seed), self.packing_factor)
        self.order = np.random.default_rng(seed).permutation(len(self.shards))
        self.cursor, self.seconds, self.sequences = 0, 0.0, 0

    def step(self, timed: bool) -> None:
        rows = self.arithmetic.micro_batch_packs
        start = time.perf_counter()
        micro_batches = []
        for _ in range(self.engine.micro_batches_per_call):
            if self.cursor + rows > len(self.order):
                self.cursor = 0
            micro_batches.append(self.shards[self.order[self.cursor : self.cursor + rows].tolist()])
            self.cursor += rows
        counts = self.engine.step(micro_batches, PER_TOKEN, 1e-3).units
        if timed:
            self.seconds += time.perf_counter() - start
            self.sequences += int(counts[1])


def profile_per_sequence(side: Side, steps: int) -> Counter:
    """ms per sequence by operator class over `steps` steps."""
    from torch.profiler import profile

    before = side.sequences
    with profile() as prof:
        for _ in range(steps):
            side.step(timed=True)
    sequences = side.sequences - before
    classes = Counter()
    for event in prof.key_averages():
        name = event.key
        if "attention" in name:
            kind = "attention (per sequence)"
        elif "Optimizer" in name or "_foreach" in name or "lerp" in name:
            kind = "optimizer (per step)"
        elif name.startswith("aten::"):
            kind = "other operators (per row / slot)"
        else:
            continue
        classes[kind] += event.self_cpu_time_total / 1000 / sequences
    return classes


def main() -> int:
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=10, help="steps per side under the profiler")
    parser.add_argument("--set", action="append", default=[], help="override a key of both runs")
    args = parser.parse_args()
    common = [*args.set, "logging.progress=false"]
    packed = Side(args.config, common, seed=1)
    unpacked_dir = Path(packed.config["data"]["train_dir"]).parent / "unpacked_baseline"
    unpacked = Side(
        args.config, [*common, f"data.train_dir={unpacked_dir}", "optim.packing_adjustment=none"], seed=1
    )
    for _ in range(args.warmup):
        packed.step(timed=False)
        unpacked.step(timed=False)
    for i in range(args.steps):  # alternate which goes first: neither always follows the other
        for side in (packed, unpacked) if i % 2 == 0 else (unpacked, packed):
            side.step(timed=True)
    rate = {name: s.sequences / s.seconds for name, s in (("packed", packed), ("unpacked", unpacked))}
    factor = packed.packing_factor
    print(
        f"{args.steps} interleaved steps each, {torch.get_num_threads()} threads; "
        f"{packed.arithmetic.describe()} | unpacked: {unpacked.arithmetic.describe()}"
    )
    print("| run | sequences | seconds | sequences/s |")
    print("|---|---|---|---|")
    for name, side in (("unpacked", unpacked), ("packed", packed)):
        print(f"| {name} | {side.sequences} | {side.seconds:.1f} | {rate[name]:.1f} |")
    speedup = rate["packed"] / rate["unpacked"]
    print(f"realized speed-up {speedup:.3f} = {speedup / factor:.3f} x packing factor {factor:.3f}")
    if args.profile:
        by_side = {
            name: profile_per_sequence(side, args.profile_steps)
            for name, side in (("unpacked", unpacked), ("packed", packed))
        }
        print("\n| ms per sequence | unpacked | packed | unpacked / packed |")
        print("|---|---|---|---|")
        for kind in sorted(set(by_side["unpacked"]) | set(by_side["packed"])):
            u, p = by_side["unpacked"][kind], by_side["packed"][kind]
            print(f"| {kind} | {u:.2f} | {p:.2f} | {u / p:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
