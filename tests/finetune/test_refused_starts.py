"""Fine-tuning and SFT refuse a start that would train on something else than asked: non-finite
or random encoder weights, a tokenizer larger than the embeddings or changed in place, configs
of wrong types, truncated weights; empty completions are not blamed on truncation."""

from __future__ import annotations

import json

import pytest
import torch

from ..folder_helpers import roberta_over_bert, variant, with_weight


def test_fine_tuning_refuses_to_start_from_non_finite_weights(hub_classifier, tmp_path):
    from packed_transformers.model.opening import ModelOptions, NonFiniteWeights, open_model

    folder = with_weight(
        hub_classifier, tmp_path / "broken", "bert.encoder.layer.0.output.dense.bias", float("nan")
    )
    with pytest.raises(NonFiniteWeights, match="bert.encoder.layer.0.output.dense.bias holds NaN"):
        open_model(folder, "classification", ModelOptions(new_head=True, config={"num_labels": 2}))


# ----- 4. SFT from a folder whose tokenizer outgrows vocab_size: one line before any work ----------
def test_sft_refuses_a_tokenizer_larger_than_the_embedding_table_before_reading_data(tmp_path, capsys):
    import yaml
    from transformers import AutoModelForCausalLM

    from packed_transformers.finetune import train

    from ..decoder_helpers import config_for, decoder_tokenizer, tiny_config

    tokenizer = decoder_tokenizer()
    start = tmp_path / "start"
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer) - 8)).save_pretrained(
        start
    )
    tokenizer.save_pretrained(start)
    capsys.readouterr()  # (save_pretrained's progress bar)
    config = config_for(tmp_path, start)
    config["data"]["train_file"] = str(tmp_path / "not_read.jsonl")  # the refusal comes first
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    code = train.main(["--config", str(path), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert (
        f"key 'vocab_size' is {len(tokenizer) - 8}, but the folder's tokenizer has {len(tokenizer)} tokens"
        in err[0]
    )
    assert not (tmp_path / "out" / "model").exists()


# ----- 5. SFT --resume after the init folder's tokenizer changed in place ---------------------------
def test_resume_refuses_a_tokenizer_changed_in_place(tmp_path):
    import shutil as files

    from transformers import AutoModelForCausalLM

    from packed_transformers.finetune import train

    from ..decoder_helpers import config_for, decoder_tokenizer, tiny_config
    from ..finetune_helpers import StopAfter

    tokenizer = decoder_tokenizer()
    start = tmp_path / "start"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(
        tiny_config("qwen2", vocab_size=len(tokenizer) + 8, max_position_embeddings=128)
    ).save_pretrained(start)
    tokenizer.save_pretrained(start)
    config = config_for(tmp_path, start)
    with pytest.raises(train.Interrupted, match="--resume"):
        train.run_finetune(config, tmp_path / "run", stop=StopAfter(2))
    kept = tmp_path / "kept_tokenizer"
    files.copytree(start, kept)
    settings = json.loads((start / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (start / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(
        train.FinetuneError, match="--resume: the tokenizer's files changed since the checkpoint"
    ):
        train.run_finetune(config, tmp_path / "run", resume=True)
    files.copyfile(kept / "tokenizer_config.json", start / "tokenizer_config.json")  # restored: resumes
    assert train.run_finetune(config, tmp_path / "run", resume=True)["train_steps"] > 0


def test_empty_completions_without_eos_are_not_blamed_on_truncation(tmp_path, capsys):
    import yaml
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from packed_transformers.finetune import train

    from ..decoder_helpers import config_for, decoder_tokenizer, tiny_config

    tokenizer = PreTrainedTokenizerFast(  # no EOS token: nothing ends an empty completion
        tokenizer_object=decoder_tokenizer().backend_tokenizer, bos_token="<s>", pad_token="<pad>"
    )
    start = tmp_path / "start"
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer))).save_pretrained(start)
    tokenizer.save_pretrained(start)
    config = config_for(tmp_path, start)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("".join(json.dumps({"prompt": f"text {i}", "completion": ""}) + "\n" for i in range(4)))
    config["data"]["train_file"] = config["data"]["validation_file"] = str(empty)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    capsys.readouterr()
    assert train.main(["--config", str(path), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "every completion is empty and the tokenizer has no EOS token" in err and "truncation" not in err


# ----- 1, 16. config and weights of different models: one line, never random weights ----------
def test_fine_tuning_may_start_a_new_head_but_never_a_random_encoder(hub_classifier, tmp_path):
    """finetune.train's loading (new_head=True): a bare encoder gets its classifier; weights of
    another family (or fewer layers) are refused, not fine-tuned from random."""
    from packed_transformers.model.bert_heads import PackedBertForSequenceClassification
    from packed_transformers.model.family_model import PackedFamilyModel

    bare = variant(hub_classifier, tmp_path / "bare", drop_weights=("classifier.",))
    model = PackedBertForSequenceClassification.from_pretrained(bare, num_labels=3, new_head=True)
    assert model.classifier.weight.shape[0] == 3
    roberta = variant(hub_classifier, tmp_path / "roberta", roberta_over_bert)
    with pytest.raises(ValueError, match="encoder weights of the model are not in the file"):
        PackedFamilyModel.from_pretrained(roberta, "classification", new_head=True, num_labels=2)
    fewer = variant(hub_classifier, tmp_path / "fewer", lambda c: c.update(num_hidden_layers=1))
    with pytest.raises(ValueError, match="encoder weights in the file are not used"):
        PackedBertForSequenceClassification.from_pretrained(fewer, num_labels=2, new_head=True)


def test_finetune_json_of_wrong_types_and_truncated_weights_are_one_line(tmp_path, capsys):
    """#14: finetune.json 'fields' as a string, and a truncated model.safetensors
    (SafetensorError), were tracebacks in commands.predict."""
    from packed_transformers.commands import predict
    from packed_transformers.model.bert_heads import PackedBertForSequenceClassification
    from packed_transformers.model.config import bert_config

    model_dir = tmp_path / "m"
    config = bert_config("bert-tiny", vocab_size=100, num_labels=2)
    config.problem_type = "single_label_classification"
    model = PackedBertForSequenceClassification(config)
    model.save_pretrained(model_dir)
    (model_dir / "vocab.txt").write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"]) + "\n"
    )
    info = {"task": "classification", "labels": ["x", "y"], "multi_label": False, "max_sequence_length": 32,
            "fields": "text"}  # fmt: skip
    (model_dir / "finetune.json").write_text(json.dumps(info))
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "a a"}) + "\n")
    capsys.readouterr()  # the save's progress bar
    args = [
        "--model",
        str(model_dir),
        "--input",
        str(tmp_path / "in.jsonl"),
        "--output",
        str(tmp_path / "p.jsonl"),
    ]
    assert predict.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'fields' must be an object" in err
    info["fields"] = {"text": "text", "pair": None, "label": None}
    (model_dir / "finetune.json").write_text(json.dumps(info))
    weights = model_dir / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    assert predict.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be loaded" in err and "truncated" in err


# ----- 6. one run per output folder: a second fine-tuning run beside a live one ---------------------
def test_a_second_run_into_a_live_runs_folder_is_refused_and_the_lock_given_back(
    checkpoint, tmp_path, capsys
):
    """Two `packed train` into one --output-dir at once would interleave checkpoints and
    metrics (an --overwrite would remove the live run's files): the second is refused in one
    line, exit 2, nothing touched; a run that ended gives the lock back (a later one in the same
    process, or another process, takes it)."""
    import subprocess
    import sys

    from packed_transformers.finetune import train

    from ..finetune_helpers import write_config

    config, out = (
        write_config(tmp_path, checkpoint, training={"epochs": 1, "progress": False}),
        tmp_path / "out",
    )
    holder = subprocess.Popen(  # another process holding the folder, as a live run's rank 0 does
        [sys.executable, "-c", "import sys, time\nfrom packed_transformers.common.files import lock_folder\n"
         "lock_folder(sys.argv[1], 'run'); print('held', flush=True); time.sleep(120)", str(out)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        code = train.main(["--config", str(config), "--output-dir", str(out), "--overwrite"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "is in use by another run" in err[0], err
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    assert train.main(["--config", str(config), "--output-dir", str(out)]) == 0
    lock = out.parent / f".{out.name}.lock"
    assert not lock.exists(), "the ended run still holds its folder"
    taker = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom packed_transformers.common.files import lock_folder\n"
         "lock_folder(sys.argv[1], 'run')", str(out)], capture_output=True, text=True,
    )  # fmt: skip
    assert taker.returncode == 0, taker.stderr
