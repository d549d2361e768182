"""Fine-tuning over torchrun's processes (issue 81: every job on the engines): 2 ranks share
each step's rows, replicated (DDP) or sharded (`execution.sharding: fsdp`, FSDP2), and end on one
process's metrics and weights at the same batches; a checkpoint one process wrote resumes on 2
sharded ranks, whose checkpoints hold the weights one process's hold, and their DCP shards one
process resumes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from packed_transformers.finetune import train as finetune
from packed_transformers.finetune.config import load_finetune_config

from ..finetune_helpers import StopAfter, assert_same_run, torchrun, write_config

# torchrun processes: the fast loop leaves them out
pytestmark = pytest.mark.slow

# no dropout: 2 ranks draw other random numbers than one process (their own streams)
MODEL = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "classifier_dropout": 0.0}


@pytest.fixture(scope="module")
def config_path(tmp_path_factory, checkpoint):
    root = tmp_path_factory.mktemp("replicas")
    return write_config(root, checkpoint, model=MODEL, training={"epochs": 2, "progress": False},
                        batching={"batch_size": 12})  # fmt: skip


@pytest.fixture(scope="module")
def one_process(config_path):
    output = config_path.parent / "one"
    finetune.run_finetune(load_finetune_config(str(config_path), []), output)
    return output


def newest_checkpoint_weights(output):
    newest = sorted((output / "checkpoints").glob("step-*"))[-1]
    return newest.name, load_file(str(newest / "model" / "model.safetensors"))


def test_4_ddp_ranks_equal_one_process_also_where_a_rank_has_no_row(config_path, tmp_path):
    """6 examples a step make 3 packed rows: 4 replicated ranks take one each, the fourth an
    empty row (no example, its loss 0), and they still train what one process trains."""
    config = load_finetune_config(str(config_path), ["batching.batch_size=6"])
    finetune.run_finetune(config, tmp_path / "one")
    done = torchrun(config_path, tmp_path / "ddp", "--set", "batching.batch_size=6", processes=4)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "4 processes share each step's rows (DDP)" in done.stderr
    # 120 examples at 1.85 a row are 65 rows in 22 steps: 3 rows a step (round(6 / 1.85)), so
    # rank 3 trains an empty row at every step
    assert "22 steps per epoch, 1.85 per packed row" in done.stderr
    assert_same_run(tmp_path / "one", tmp_path / "ddp")
    summary = json.loads(done.stdout)  # rank 0 alone prints the run's summary
    assert (
        summary["train_steps"] == json.loads((tmp_path / "one" / "summary.json").read_text())["train_steps"]
    )


def test_a_checkpoint_of_one_process_resumes_on_2_fsdp_ranks_to_the_same_run(
    config_path, one_process, tmp_path
):
    """One process stops inside epoch 0 (its checkpoint); 2 sharded ranks resume it (each takes
    its shards of the whole weights and AdamW moments): the epochs' metrics and the final weights
    of the uninterrupted process, and checkpoints holding its weights (one format)."""
    config = load_finetune_config(str(config_path), [])
    with pytest.raises(finetune.Interrupted):
        finetune.run_finetune(config, tmp_path / "run", stop=StopAfter(4))
    done = torchrun(config_path, tmp_path / "run", "--resume", "--set", "execution.sharding=fsdp")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 processes share each step's rows (FSDP2)" in done.stderr and "resumed from" in done.stderr
    assert_same_run(one_process, tmp_path / "run")
    (name, sharded), (one_name, whole) = (
        newest_checkpoint_weights(r) for r in (tmp_path / "run", one_process)
    )
    assert name == one_name and sharded.keys() == whole.keys()  # one format: the same names, tied once
    assert all(torch.allclose(sharded[k], whole[k], rtol=0, atol=1e-5) for k in whole)


def test_fsdp_without_torchrun_and_with_compile_is_refused_in_one_line(config_path, tmp_path, capsys):
    alone = finetune.main(["--config", str(config_path), "--output-dir", str(tmp_path / "alone"),
                           "--set", "execution.sharding=fsdp"])  # fmt: skip
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert alone == 2 and "execution.sharding fsdp: needs 2 or more processes" in line
    assert not (tmp_path / "alone").exists()
    compiled = finetune.main(["--config", str(config_path), "--output-dir", str(tmp_path / "compiled"),
                              "--set", "execution.sharding=fsdp", "--set", "training.compile=true"])  # fmt: skip
    assert compiled == 2 and "not with execution.sharding fsdp" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tied_start(tmp_path_factory):
    """A tiny random Qwen2 whose output layer is its embedding table (tie_word_embeddings)."""
    from transformers import AutoModelForCausalLM

    from ..decoder_helpers import decoder_tokenizer, tiny_config

    folder = tmp_path_factory.mktemp("tied") / "start"
    tokenizer = decoder_tokenizer()
    torch.manual_seed(0)
    config = tiny_config(
        "qwen2", vocab_size=len(tokenizer) + 8, max_position_embeddings=128, tie_word_embeddings=True
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_sft_of_a_tied_decoder_with_fsdp_at_2_ranks_equals_one_process(tied_start, tmp_path):
    """A decoder's SFT (the loss over completion tokens of every rank) sharded over 2 ranks:
    one process's metrics and weights, the tied output layer saved once and tied on load."""
    import yaml
    from transformers import AutoModelForCausalLM

    from ..decoder_helpers import config_for

    config = config_for(tmp_path, tied_start, epochs=2)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    finetune.run_finetune(config, tmp_path / "one")
    done = torchrun(tmp_path / "config.yaml", tmp_path / "fsdp", "--set", "execution.sharding=fsdp")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(tmp_path / "one", tmp_path / "fsdp")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "model")
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight


def test_a_sharded_runs_checkpoint_is_dcp_shards_and_resumes_in_one_process(config_path, tmp_path):
    """2 sharded ranks checkpoint as every sharded run does (engines.torch_engine.TorchStep.
    snapshot): each rank's shards of the weights and AdamW moments in dcp/, model/ the
    weights gathered whole, no optimizer in training_state.pt; one process resumes it (DCP read
    into whole tensors) and writes the run's model with those weights. The ranks gather the
    weights whole once: for the one checkpoint, whose gather the final save takes (it had
    gathered them again)."""
    import shutil

    counts = tmp_path / "gathers"
    counts.mkdir()
    done = torchrun(config_path, tmp_path / "run", "--set", "execution.sharding=fsdp", "--set", "training.epochs=1",
                    module="tests.finetune.counted_gathers", env={"GATHER_COUNTS": str(counts)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(sorted((tmp_path / "run" / "checkpoints").glob("step-*"))) == 1
    assert [(counts / f"rank-{r}.txt").read_text() for r in (0, 1)] == ["1", "1"]
    newest = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1]
    assert (newest / "dcp" / ".metadata").is_file() and len(list((newest / "dcp").glob("*.distcp"))) == 2
    assert "optimizer" not in torch.load(newest / "training_state.pt", weights_only=True)
    written = load_file(str(tmp_path / "run" / "model" / "model.safetensors"))
    # as a run killed after its last checkpoint, before its outputs: the resume writes them
    shutil.rmtree(tmp_path / "run" / "model")
    (tmp_path / "run" / "summary.json").unlink()
    config = load_finetune_config(str(config_path), ["training.epochs=1"])
    finetune.run_finetune(config, tmp_path / "run", resume=True)
    again = load_file(str(tmp_path / "run" / "model" / "model.safetensors"))
    assert again.keys() == written.keys() and all(torch.equal(again[k], written[k]) for k in written)
