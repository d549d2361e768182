"""FSDP2 for BERT pretraining (`execution.sharding: fsdp`, issue 81) on CPUs with gloo: the torch
engine shards each encoder layer and the model; LAMB's trust ratios and the clipping norm are
over whole tensors; 2 ranks end on one process's losses and weights at the same global batch;
the checkpoint keeps the one format (weights and optimizer state whole), so 2 ranks resume onto
4, and an unsharded run resumes a sharded one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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


def test_fsdp_at_2_ranks_equals_one_process_and_checkpoints_as_every_sharded_job(
    packed, one_process, tmp_path
):
    two = config(packed, tmp_path / "two.yaml", 2, execution={"sharding": "fsdp"})
    done = run(two, tmp_path / "two", torchrun=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "FSDP2: 2 encoder layers and the model sharded over 2 ranks" in done.stdout + done.stderr
    assert_same_run(one_process, tmp_path / "two")

    # the checkpoint is every sharded job's (TorchStep.snapshot): one process's files, the
    # optimizer in dcp/ (each rank's shards of LAMB's moments) instead of in training_state.pt
    def files(run_dir):
        return {
            p.relative_to(run_dir).as_posix() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()
        }

    one, two_files = files(one_process), files(tmp_path / "two")
    assert {f for f in two_files if "/dcp/" not in f} == one
    newest = sorted((tmp_path / "two" / "checkpoints").glob("step-*"))[-1]
    assert len(list((newest / "dcp").glob("*.distcp"))) == 2
    assert "optimizer" not in torch.load(newest / "training_state.pt", weights_only=True)


def test_fsdp_resumes_onto_4_ranks_and_an_unsharded_run_resumes_it(packed, one_process, tmp_path):
    first = config(
        packed, tmp_path / "first.yaml", 2, execution={"sharding": "fsdp"}, training={"max_steps": 2}
    )
    done = run(first, tmp_path / "run", torchrun=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    import shutil

    shutil.copytree(tmp_path / "run", tmp_path / "plain")
    shutil.copytree(tmp_path / "run", tmp_path / "staged")
    four = config(packed, tmp_path / "four.yaml", 1, execution={"sharding": "fsdp"})
    done = run(four, tmp_path / "run", "--resume", torchrun=4)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_same_run(one_process, tmp_path / "run")
    plain = config(packed, tmp_path / "plain.yaml", 4)
    done = run(plain, tmp_path / "plain", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(one_process, tmp_path / "plain")
    # the pipeline engine keeps the optimizer whole: it refuses a sharded run's dcp/ in one line
    staged = config(packed, tmp_path / "staged.yaml", 4, execution={"layers_per_stage": [1, 1], "threads": 1})
    done = run(staged, tmp_path / "staged", "--resume", torchrun=2)
    assert done.returncode != 0 and "(exitcode: 2)" in done.stderr, done.stderr[-3000:]
    assert "keeps its optimizer as a sharded run's dcp/ shards, which the pipeline engine does not read" in (
        done.stdout + done.stderr
    )


def test_fsdp_is_refused_in_one_line_where_it_cannot_run(packed, tmp_path):
    alone = run(config(packed, tmp_path / "a.yaml", 4, execution={"sharding": "fsdp"}), tmp_path / "alone")
    assert alone.returncode == 2 and "needs 2 or more processes" in alone.stderr.strip().splitlines()[-1]
    staged = run(config(packed, tmp_path / "b.yaml", 4, execution={"sharding": "fsdp", "layers_per_stage": [1, 1]}),
                 tmp_path / "staged")  # fmt: skip
    assert (
        staged.returncode == 2
        and "not with execution.layers_per_stage" in staged.stderr.strip().splitlines()[-1]
    )


def test_a_resume_may_split_the_global_batch_another_way_but_not_change_it(packed, one_process, tmp_path):
    first = config(packed, tmp_path / "a.yaml", 4, training={"max_steps": 2})
    assert run(first, tmp_path / "run").returncode == 0
    other = run(config(packed, tmp_path / "b.yaml", 2), tmp_path / "run", "--resume")
    last = other.stderr.strip().splitlines()[-1]
    assert other.returncode == 2 and "the global batch must stay" in last and "4 process" not in last, last
    # the one process's checkpoint (LAMB's state whole, as every checkpoint before dcp/ was) on 2
    # sharded ranks, each taking its shards: the uninterrupted run
    sharded = config(packed, tmp_path / "c.yaml", 2, execution={"sharding": "fsdp"})
    done = run(sharded, tmp_path / "run", "--resume", torchrun=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_same_run(one_process, tmp_path / "run")
