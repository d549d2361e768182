"""FSDP2 for BERT pretraining (`execution.sharding: fsdp`, issue 81) on CPUs with gloo: the torch
engine shards each encoder layer and the model; LAMB's trust ratios and the clipping norm are
over whole tensors; 2 ranks end on one process's losses and weights at the same global batch;
the checkpoint keeps the one format (weights and optimizer state whole), so 2 ranks resume onto
4, and an unsharded run resumes a sharded one."""

from __future__ import annotations

import numpy as np
import pytest

from ..training_helpers import final_weights, metrics, run, write_config

pytestmark = pytest.mark.slow  # torchrun processes

NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}


def config(packed, path, accumulation: int, **sections):
    return write_config(path, packed, model=NO_DROPOUT, optim={"gradient_accumulation": accumulation},
                        training={"max_steps": 4, "checkpoint_every_steps": 2, **sections.pop("training", {})},
                        **sections)  # fmt: skip


def assert_same_run(a, b, atol=1e-5):
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    assert max((wa[n] - wb[n]).abs().max().item() for n in wa) < atol
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb]
    assert [r["masked_tokens"] for r in ma] == [r["masked_tokens"] for r in mb]  # exact sums
    np.testing.assert_allclose([r["loss"] for r in ma], [r["loss"] for r in mb], rtol=1e-5)


@pytest.fixture(scope="module")
def one_process(packed, tmp_path_factory):
    root = tmp_path_factory.mktemp("bert_one")
    done = run(config(packed, root / "one.yaml", 4), root / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "run"


def test_fsdp_at_2_ranks_equals_one_process_and_keeps_the_checkpoint_format(packed, one_process, tmp_path):
    two = config(packed, tmp_path / "two.yaml", 2, execution={"sharding": "fsdp"})
    done = run(two, tmp_path / "two", torchrun=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "FSDP2: 2 encoder layers and the model sharded over 2 ranks" in done.stdout + done.stderr
    assert_same_run(one_process, tmp_path / "two")
    # the checkpoint is the unsharded format: the same files as one process writes
    a = sorted(p.relative_to(one_process) for p in (one_process / "checkpoints").rglob("*") if p.is_file())
    b = sorted(
        p.relative_to(tmp_path / "two") for p in (tmp_path / "two" / "checkpoints").rglob("*") if p.is_file()
    )
    assert a == b


def test_fsdp_resumes_onto_4_ranks_and_an_unsharded_run_resumes_it(packed, one_process, tmp_path):
    first = config(
        packed, tmp_path / "first.yaml", 2, execution={"sharding": "fsdp"}, training={"max_steps": 2}
    )
    done = run(first, tmp_path / "run", torchrun=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    import shutil

    shutil.copytree(tmp_path / "run", tmp_path / "plain")
    four = config(packed, tmp_path / "four.yaml", 1, execution={"sharding": "fsdp"})
    done = run(four, tmp_path / "run", "--resume", torchrun=4)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_same_run(one_process, tmp_path / "run")
    plain = config(packed, tmp_path / "plain.yaml", 4)
    done = run(plain, tmp_path / "plain", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(one_process, tmp_path / "plain")


def test_fsdp_is_refused_in_one_line_where_it_cannot_run(packed, tmp_path):
    alone = run(config(packed, tmp_path / "a.yaml", 4, execution={"sharding": "fsdp"}), tmp_path / "alone")
    assert alone.returncode == 2 and "needs 2 or more processes" in alone.stderr.strip().splitlines()[-1]
    staged = run(config(packed, tmp_path / "b.yaml", 4, execution={"sharding": "fsdp", "layers_per_stage": [1, 1]}),
                 tmp_path / "staged")  # fmt: skip
    assert (
        staged.returncode == 2
        and "not with execution.layers_per_stage" in staged.stderr.strip().splitlines()[-1]
    )


def test_a_resume_may_split_the_global_batch_another_way_but_not_change_it(packed, tmp_path):
    first = config(packed, tmp_path / "a.yaml", 4, training={"max_steps": 2})
    assert run(first, tmp_path / "run").returncode == 0
    other = run(config(packed, tmp_path / "b.yaml", 2), tmp_path / "run", "--resume")
    last = other.stderr.strip().splitlines()[-1]
    assert other.returncode == 2 and "the global batch must stay" in last and "4 process" not in last, last
