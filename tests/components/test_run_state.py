"""The one run state (components.run_state.RunState, issue 95): every job's progress in its
`extra`, one JSON form in training_state.pt, and the checkpoints written before it read into
it: BERT's fields flat beside its optimizer, the decoder's in "state" without "extra",
fine-tuning's named "steps" and "train_examples"."""

from __future__ import annotations

import json
import math

from packed_transformers.components.data import LoaderPosition
from packed_transformers.components.run_state import BertProgress, RunState
from packed_transformers.finetune.checkpoint import FinetuneProgress
from packed_transformers.training.decoder.run import DecoderProgress


def test_every_jobs_state_round_trips_through_training_state():
    states = [
        RunState(7, 90, 100, False, 1.5, 2, BertProgress(LoaderPosition(1, 12), 0.4, {"a": [1]}, "ab", 64)),
        RunState(3, 24, 32, True, 0.0, 0, DecoderProgress(4000, math.inf, 8)),
        RunState(
            5, 50, 0, False, 2.0, 0, FinetuneProgress({"b": 1}, {"train_file": "00"}, 1, 2, padding=[0.5])
        ),
    ]
    for state in states:
        saved = {**state.state_dict(), "rng": [], "optimizer": {"state": {}}}  # training_state.pt's parts
        assert isinstance(saved["state"], str)
        assert RunState.from_saved(saved, type(state.extra)) == state
        restored = RunState(extra=type(state.extra)())  # a Stateful part, loaded in place
        restored.load_state_dict(saved)
        assert restored == state


def test_bert_checkpoints_before_it_kept_their_fields_flat():
    flat = {"optimizer": {}, "rng": [], "step": 4, "samples": 30, "position": {"epoch": 0, "micro_batches": 8},
            "next_eval_samples": 40, "best_eval_accuracy": 0.25, "train_seconds": 3.0, "skipped_steps": 1,
            "config": {"c": 1}, "data_identity": "ff", "packs_per_step": 16}  # fmt: skip
    state = RunState.from_saved(flat, BertProgress)
    assert (state.step, state.samples, state.next_eval_samples, state.skipped_steps) == (4, 30, 40, 1)
    assert state.extra == BertProgress(LoaderPosition(0, 8), 0.25, {"c": 1}, "ff", 16)


def test_decoder_and_finetuning_checkpoints_before_it_resume_under_the_new_names():
    decoder = {"step": 2, "samples": 16, "tokens": 900, "next_eval_samples": 32, "best_log_perplexity": 3.5,
               "reached_target": False, "rows_per_step": 8}  # fmt: skip
    state = RunState.from_saved({"state": json.dumps(decoder), "rng": []}, DecoderProgress)
    assert (state.step, state.samples, state.extra) == (2, 16, DecoderProgress(900, 3.5, 8))
    finetune = {"config": {"d": 2}, "data_sha256": {}, "epoch": 1, "batches_done": 0, "sums": {}, "steps": 9,
                "train_seconds": 4.0, "train_examples": 72, "padding": [0.1], "finished": True}  # fmt: skip
    state = RunState.from_saved({"state": json.dumps(finetune)}, FinetuneProgress)
    assert (state.step, state.samples, state.train_seconds) == (9, 72, 4.0)
    assert state.extra == FinetuneProgress({"d": 2}, {}, 1, 0, {}, [0.1], True)


def test_a_training_state_without_a_run_state_is_refused_in_one_line_naming_the_file():
    import pytest

    from packed_transformers.components.checkpoint import CheckpointError

    for saved in ({"state": "not json"}, {"state": "[1, 2]"}, {"state": json.dumps({"step": 1, "extra": 5})}):
        with pytest.raises(CheckpointError, match=r"^step-3/training_state.pt: holds no run state") as caught:
            RunState.from_saved(saved, DecoderProgress, "step-3/training_state.pt")
        assert "\n" not in str(caught.value)


def test_the_manager_writes_each_parts_entries_and_names_the_file_a_part_cannot_read(tmp_path):
    """components.run_checkpoint: training_state.pt holds each Stateful part's entries and the
    engine's; restore puts each part back, and a run state this version cannot read is refused
    naming the checkpoint's file (the part itself knows no path)."""
    from types import SimpleNamespace

    import pytest
    import torch

    from packed_transformers.components import run_checkpoint
    from packed_transformers.components.checkpoint import CheckpointError
    from packed_transformers.engines.engine import Snapshot

    def write_model(folder):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"w")
        (folder / "config.json").write_text("{}")

    snapshot = Snapshot(SimpleNamespace(save_pretrained=write_model), {"optimizer": {"state": {}}})
    state = RunState(4, 40, 48, False, 1.0, 0, DecoderProgress(900, 3.5, 8))
    torch.manual_seed(7)
    path = run_checkpoint.write_checkpoint(tmp_path, (state, run_checkpoint.RngStates(0)), 2, snapshot, 0)
    assert path.name == "step-00000004"
    expected = torch.rand(3)
    torch.manual_seed(0)  # moved on; restore puts the checkpoint's stream back
    restored = RunState(extra=DecoderProgress())
    _, saved = run_checkpoint.restore(
        tmp_path, lambda path, saved: None, (restored, run_checkpoint.RngStates(0))
    )
    assert set(saved) == {"state", "rng", "optimizer"} and restored == state
    assert torch.equal(torch.rand(3), expected)  # the RNG where the checkpoint left it

    unreadable = SimpleNamespace(step=5, state_dict=lambda: {"state": "not json"})
    run_checkpoint.write_checkpoint(tmp_path, (unreadable,), 2, snapshot, 0)
    with pytest.raises(
        CheckpointError, match=r"step-00000005/training_state.pt: holds no run state"
    ) as caught:
        run_checkpoint.restore(tmp_path, lambda path, saved: None, (RunState(extra=DecoderProgress()),))
    assert "\n" not in str(caught.value)
