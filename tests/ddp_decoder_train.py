"""Run by tests/model/test_decoders.py under `torch.distributed.run` (2 processes, gloo, CPU) and
alone (1 process): transformers' Trainer trains the packed decoder (PackedFamilyModel,
causal_lm) on the same 8 packs, in order, 4 per optimizer step (2 processes x 2 accumulated
micro-batches, or 1 process x 4), and process 0 writes the final weights.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/ddp_decoder_train.py START OUT ACCUMULATE
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from safetensors.torch import save_file
from transformers import Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from packed_transformers.hf_integration.trainer import PackedDataCollator, pack_dataset  # noqa: E402
from packed_transformers.model.family_model import PackedFamilyModel  # noqa: E402

VOCAB = 96


def packs():
    """8 packs of 32 tokens from 30 random sequences, prompt tokens masked in every other one."""
    rng = np.random.default_rng(0)
    sequences = [rng.integers(3, VOCAB, size=int(n)).tolist() for n in rng.integers(2, 20, size=30)]
    labels = [[-100, -100, *s[2:]] if i % 2 else list(s) for i, s in enumerate(sequences)]
    data = Dataset.from_dict({"input_ids": sequences, "labels": labels})
    packed = pack_dataset(data, "causal_lm", 32, max_sequences_per_pack=4, verbose=False)
    return packed.select(range(8))


def main(start: str, out: str, accumulate: int) -> None:
    torch.manual_seed(0)
    model = PackedFamilyModel.from_pretrained(start, "causal_lm")
    arguments = TrainingArguments(
        output_dir=str(Path(out).parent / "trainer"), per_device_train_batch_size=1,
        gradient_accumulation_steps=accumulate, learning_rate=1e-3, max_steps=2, report_to=[], use_cpu=True,
        save_strategy="no", seed=0, train_sampling_strategy="sequential", logging_steps=1,
        ddp_timeout=120,  # a collective that waits longer ends the rank (gloo's default: 30 minutes)
    )  # fmt: skip
    trainer = Trainer(model=model, args=arguments, train_dataset=packs(), data_collator=PackedDataCollator())
    trainer.train()
    if trainer.is_world_process_zero():
        state = {name: tensor.detach().clone() for name, tensor in trainer.model.state_dict().items()}
        save_file(state, out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # rank 0's weights are on disk before any rank ends


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    # Ended without the interpreter's teardown, where gloo's group is destroyed. Two ends seen
    # on a loaded machine, both in that teardown: "terminate called without an active
    # exception" (SIGABRT, CI 2026-11-27), and a hang, 1 run in 25 (gdb, 2026-11-29): the main
    # thread, holding the GIL, destroyed DDP's Reducer, whose last reference to the group ran
    # ~ProcessGroupGloo, which joins gloo's worker threads; one of them was destroying the
    # barrier's finished work, whose tensors' Python objects need the GIL: each waited for the
    # other (torch's open issues 56297 and 190489, process-group destructors that block with
    # the GIL held). Trainer keeps the DDP model, so the teardown's order is not this script's
    # to choose; with the weights written and the barrier passed nothing is left to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
