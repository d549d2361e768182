"""The seventh hostile test (issue: reliability 7): weights that are not finite, tokens as
transformers makes them, outputs as transformers returns them, YAML that eats the machine,
a server that bounds headers, shards of other dtypes. Each test fails without its fix."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from .conftest import REPO
from .folder_helpers import one_line_error, run_module, tiny_hub_classifier
from .servers import free_port


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny BERT classifier folder as transformers saves it (tokenizer.json, safetensors)."""
    return tiny_hub_classifier(tmp_path_factory.mktemp("seventh") / "classifier")


def with_weight(folder, where, name, value):
    """A copy of `folder` whose weight `name` holds `value` at its first element."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, where)
    weights = load_file(where / "model.safetensors")
    weights[name].view(-1)[0] = value
    save_file(weights, where / "model.safetensors", metadata={"format": "pt"})
    return where


def input_file(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


# ----- 1. (high) non-finite weights are never run --------------------------------------------------
@pytest.mark.parametrize("value, what", [(float("nan"), "NaN"), (float("inf"), "inf")])
def test_a_folder_with_a_non_finite_weight_is_refused_by_every_door(classifier, tmp_path, value, what):
    from packed_transformers.data.classification_data import ExampleError
    from packed_transformers.door.folder import load_finetuned
    from packed_transformers.inference.embedding import load_encoder

    folder = with_weight(classifier, tmp_path / "broken", "classifier.weight", value)
    with pytest.raises(ExampleError, match=rf"model\.safetensors: weight classifier\.weight holds {what}"):
        load_finetuned(folder)
    encoder = with_weight(
        classifier, tmp_path / "broken_encoder", "bert.embeddings.word_embeddings.weight", value
    )
    with pytest.raises(ExampleError, match=rf"weight bert\.embeddings\.word_embeddings\.weight holds {what}"):
        load_encoder(encoder, pooling="mean")


def test_scores_that_are_not_finite_are_never_written():
    from packed_transformers.data.classification_data import ExampleError
    from packed_transformers.inference.predictions import prediction_records

    logits = np.array([[0.0, 1.0], [np.nan, 0.0]], dtype=np.float32)
    with pytest.raises(ExampleError, match="example 1: the model's scores are not finite"):
        list(prediction_records(logits, ["a", "b"], multi_label=False))


@pytest.mark.slow  # three commands in fresh interpreters
def test_predict_embed_and_the_server_refuse_nan_weights_in_one_line(classifier, tmp_path):
    folder = with_weight(classifier, tmp_path / "broken", "classifier.weight", float("nan"))
    source = input_file(tmp_path / "in.jsonl", ["a text", "another text"])
    done = run_module(
        "packed_transformers.finetune.predict",
        "--model",
        folder,
        "--input",
        source,
        "--output",
        tmp_path / "o.jsonl",
    )
    assert "model.safetensors: weight classifier.weight holds NaN" in one_line_error(done)
    assert not (tmp_path / "o.jsonl").exists()
    encoder = with_weight(
        classifier, tmp_path / "enc", "bert.encoder.layer.0.output.dense.weight", float("nan")
    )
    done = run_module(
        "packed_transformers.finetune.embed",
        "--model",
        encoder,
        "--input",
        source,
        "--output",
        tmp_path / "v.npy",
        "--pooling",
        "mean",
    )
    assert "weight bert.encoder.layer.0.output.dense.weight holds NaN" in one_line_error(done)
    assert not (tmp_path / "v.npy").exists()
    done = subprocess.run(
        [sys.executable, "-m", "packed_transformers.serving", "--model", str(folder), "--port", str(free_port())],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert "weight classifier.weight holds NaN" in one_line_error(done)


def test_fine_tuning_refuses_to_start_from_non_finite_weights(classifier, tmp_path):
    from packed_transformers.model.opening import ModelOptions, NonFiniteWeights, open_model

    folder = with_weight(
        classifier, tmp_path / "broken", "bert.encoder.layer.0.output.dense.bias", float("nan")
    )
    with pytest.raises(NonFiniteWeights, match="bert.encoder.layer.0.output.dense.bias holds NaN"):
        open_model(folder, "classification", ModelOptions(new_head=True, config={"num_labels": 2}))


# ----- 2. (high) tokens exactly as transformers makes them -------------------------------------------
COMBINING = ["e\u0301 a\u0308 o\u0302 cafe\u0301", "Zoe\u0308 and Ame\u0301lie", "plain text"]


@pytest.fixture(scope="module")
def qwen2_classifier(tmp_path_factory):
    """A tiny Qwen2 classification folder whose tokenizer.json has no normalizer, and whose
    tokenizer_config.json names Qwen2Tokenizer: transformers' class adds NFC and Qwen2's
    split pattern whatever the file says."""
    import transformers

    from .decoder_helpers import decoder_tokenizer, tiny_config

    folder = tmp_path_factory.mktemp("qwen2") / "classifier"
    decoder_tokenizer().save_pretrained(folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["tokenizer_class"] = "Qwen2Tokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)  # Qwen2's class adds its own specials
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(
        tiny_config("qwen2", num_labels=3, vocab_size=len(tokenizer))
    )
    model.save_pretrained(folder)
    assert json.loads((folder / "tokenizer.json").read_text())["normalizer"] is None
    return folder


def test_a_folder_is_tokenized_as_autotokenizer_tokenizes_it(qwen2_classifier):
    from transformers import AutoTokenizer

    from packed_transformers.door.folder import load_finetuned
    from packed_transformers.inference.embedding import load_encoder

    reference = AutoTokenizer.from_pretrained(qwen2_classifier)
    expected = [reference(text)["input_ids"] for text in COMBINING]
    from tokenizers import Tokenizer

    alone = Tokenizer.from_file(str(qwen2_classifier / "tokenizer.json"))
    assert [alone.encode(t).ids for t in COMBINING] != expected  # the file alone differs (the defect)
    assert [load_finetuned(qwen2_classifier).tokenizer.encode(t).ids for t in COMBINING] == expected
    ids, _ = load_encoder(qwen2_classifier, pooling="lasttoken").tokenize_texts(
        COMBINING, ["t"] * len(COMBINING)
    )
    assert [list(map(int, i)) for i in ids] == expected


def test_predict_scores_equal_transformers_on_text_with_combining_marks(qwen2_classifier, tmp_path):
    import transformers
    from transformers import AutoTokenizer

    from packed_transformers.commands import predict

    source = input_file(tmp_path / "in.jsonl", COMBINING)
    assert (
        predict.main(
            ["--model", str(qwen2_classifier), "--input", str(source), "--output", str(tmp_path / "p.jsonl")]
        )
        == 0
    )
    got = [json.loads(line)["scores"] for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(qwen2_classifier).eval()
    tokenizer = AutoTokenizer.from_pretrained(qwen2_classifier)
    for text, scores in zip(COMBINING, got):
        with torch.no_grad():
            probs = model(**tokenizer(text, return_tensors="pt")).logits.softmax(-1)[0]
        assert np.allclose(list(scores.values()), probs.numpy(), atol=2e-6), text


# ----- 3. outputs as transformers returns them ------------------------------------------------------
def test_every_packed_model_answers_its_outputs_as_attributes(classifier, tmp_path):
    """`model(**batch).loss` as on any transformers model (a plain dict raised AttributeError);
    an unset declared field reads None, as a ModelOutput's does; index access as to_tuple."""
    import transformers

    from packed_transformers.model.opening import ModelOptions, open_model

    from .decoder_helpers import packed_rows, tiny_config

    config = tiny_config("llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    model = open_model(tmp_path / "llama", "causal_lm", ModelOptions()).model
    rows, _ = packed_rows()
    out = model.eval()(**rows, labels=rows["input_ids"])
    assert out.loss is out["loss"] and out.logits is out["logits"] and out[0] is out.loss
    trained = model.train()(**rows, labels=rows["input_ids"])  # the head only where a target is
    assert trained.logits is None and trained.loss is trained["loss"] and trained[0] is trained.loss
    assert torch.isfinite(out.loss)
    assert model(**rows).loss is None
    with pytest.raises(AttributeError, match="has no output 'lossy'"):
        out.lossy  # noqa: B018
    bert = open_model(classifier, "classification", ModelOptions()).model
    head_out = bert(**{**rows, "input_ids": rows["input_ids"] % 50})
    assert head_out.logits is head_out["logits"] and head_out.loss is None


# ----- 6, 8, 14. YAML: alias bombs, a list config with --set, a key given twice ---------------------
def alias_bomb(levels: int = 9) -> str:
    """Each level a list of nine aliases of the one before: 9^levels values in < 500 bytes."""
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + f"\ntraining:\n  lr: *a{levels - 1}\n"


CONFIG_LOADERS = [
    ("packed_transformers.finetune.config", "load_finetune_config"),
    ("packed_transformers.training.config", "load_config"),
]


@pytest.mark.parametrize("module, loader", CONFIG_LOADERS)
def test_an_alias_bomb_is_one_bounded_line_in_little_memory(tmp_path, module, loader):
    import importlib
    import tracemalloc

    from packed_transformers.common.config_schema import ConfigError

    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert len(path.read_bytes()) < 1024
    load = getattr(importlib.import_module(module), loader)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as caught:
            load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(caught.value)
    assert "aliases expand to more than 100,000 values" in message and len(message) < 300
    assert "\n" not in message and peak < 50 * 2**20


@pytest.mark.parametrize("module, loader", CONFIG_LOADERS)
def test_wrong_values_are_quoted_in_bounded_excerpts(tmp_path, module, loader):
    import importlib

    from packed_transformers.common.config_schema import ConfigError

    load = getattr(importlib.import_module(module), loader)
    path = tmp_path / "long.yaml"
    path.write_text("training:\n  seed: [" + ", ".join(["1"] * 5000) + "]\n")
    with pytest.raises(ConfigError, match=r"training.seed: expected an integer, got a list of 5000 items$"):
        load(path)
    path.write_text("training:\n  seed: '" + "y" * 5000 + "'\n")
    with pytest.raises(ConfigError, match=r"got 'yyyy.*\.\.\. \(5002 characters\)$"):
        load(path)


def test_self_referring_aliases_are_one_line(tmp_path):
    from packed_transformers.common.config_schema import ConfigError, read_yaml

    path = tmp_path / "loop.yaml"
    path.write_text("training: &t\n  seed: *t\n")
    with pytest.raises(ConfigError, match="an alias refers to the value that holds it"):
        read_yaml(path)


@pytest.mark.parametrize("module, loader", CONFIG_LOADERS)
def test_a_config_that_is_a_list_is_one_line_with_or_without_set(tmp_path, module, loader):
    import importlib

    from packed_transformers.common.config_schema import ConfigError

    load = getattr(importlib.import_module(module), loader)
    path = tmp_path / "list.yaml"
    path.write_text("- training\n- data\n")
    for assignments in ([], ["training.seed=3"]):
        with pytest.raises(ConfigError, match=r"list.yaml: expected a mapping of sections, got list$"):
            load(path, assignments)


@pytest.mark.parametrize("module, loader", CONFIG_LOADERS)
def test_a_key_given_twice_is_refused_as_json_lines_refuse_it(tmp_path, module, loader):
    import importlib

    from packed_transformers.common.config_schema import ConfigError

    load = getattr(importlib.import_module(module), loader)
    path = tmp_path / "twice.yaml"
    path.write_text("training:\n  seed: 1\n  seed: 2\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: key 'seed' is given twice in one mapping \(line 3\)"):
        load(path)
    path.write_text("training: {}\ntraining: {}\n")
    with pytest.raises(ConfigError, match=r"key 'training' is given twice"):
        load(path)
    # a merge key (<<) is YAML's way to override on purpose: still allowed
    path.write_text("base: &b {seed: 1}\n")
    from packed_transformers.common.config_schema import read_yaml

    path.write_text("training:\n  <<: {seed: 1}\n  seed: 2\n")
    assert read_yaml(path) == {"training": {"seed": 2}}


def test_a_set_value_that_is_not_yaml_is_one_line(tmp_path):
    from packed_transformers.common.config_schema import ConfigError
    from packed_transformers.finetune.config import load_finetune_config

    path = tmp_path / "c.yaml"
    path.write_text("training:\n  seed: 1\n")
    with pytest.raises(ConfigError, match=r"--set training.seed: not valid YAML"):
        load_finetune_config(path, ["training.seed=[1,"])


@pytest.mark.slow  # both commands in fresh interpreters
def test_both_commands_refuse_the_bomb_and_a_list_with_set_in_one_line(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n")
    for argv in (
        ["packed_transformers.finetune.train", "--config", bomb, "--output-dir", tmp_path / "o1"],
        [
            "packed_transformers.finetune.train",
            "--config",
            listed,
            "--output-dir",
            tmp_path / "o2",
            "--set",
            "training.seed=1",
        ],
    ):
        assert "bomb.yaml" in one_line_error(run_module(*argv)) or "list.yaml" in argv[2].name
    for config in (bomb, listed):
        done = subprocess.run(
            [sys.executable, "run_pretraining.py", "--config", str(config), "--output-dir", str(tmp_path / "p"),
             "--set", "training.seed=1"],
            cwd=REPO, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert config.name in one_line_error(done)


# ----- 4. SFT from a folder whose tokenizer outgrows vocab_size: one line before any work ----------
def test_sft_refuses_a_tokenizer_larger_than_the_embedding_table_before_reading_data(tmp_path, capsys):
    import yaml
    from transformers import AutoModelForCausalLM

    from packed_transformers.finetune import train

    from .decoder_helpers import config_for, decoder_tokenizer, tiny_config

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

    from .decoder_helpers import config_for, decoder_tokenizer, tiny_config
    from .finetune_helpers import StopAfter

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


# ----- 9. packed shards of other dtypes: one line naming shard and field ---------------------------
def rewrite_shard(packed, change):
    """Shard 0 rewritten with `change(fields)` applied (metadata kept consistent)."""
    import h5py

    from packed_transformers.common.files import sha256_file

    meta = json.loads((packed / "metadata.json").read_text())
    shard = packed / meta["shards"][0]["name"]
    with h5py.File(shard) as f:
        fields = {name: f[name][:] for name in f}
    shard.unlink()
    with h5py.File(shard, "w") as f:
        for name, values in change(fields).items():
            if values is None:
                f.create_group(name)
            else:
                f.create_dataset(name, data=values)
    meta["shards"][0].update(bytes=shard.stat().st_size, sha256=sha256_file(shard))
    (packed / "metadata.json").write_text(json.dumps(meta))
    return shard


@pytest.mark.parametrize(
    "name, change, expected",
    [
        ("int8_ids", lambda f: {**f, "input_ids": f["input_ids"].astype(np.int8)},
         "field 'input_ids' has dtype int8, expected integers holding uint16"),
        ("bytes_segments", lambda f: {**f, "segment_ids": f["segment_ids"].astype("S1")},
         "field 'segment_ids' has dtype |S1, expected integers holding uint8"),
        ("group", lambda f: {**f, "sequence_ids": None}, "field 'sequence_ids' is a group, expected a dataset"),
        ("float_ids", lambda f: {**f, "input_ids": f["input_ids"] + 0.5},
         "field 'input_ids' has dtype float64, expected integers"),
        ("negative_ids", lambda f: {**f, "input_ids": np.where(np.arange(f["input_ids"].shape[1]) == 3, -5,
                                                               f["input_ids"].astype(np.int32))},
         "field 'input_ids' holds a negative value at row 0"),
        ("wider_is_fine", lambda f: {**f, "input_ids": f["input_ids"].astype(np.int64)}, None),
    ],
)  # fmt: skip
def test_each_field_dtype_is_checked_when_a_shard_is_opened(tmp_path, name, change, expected):
    from packed_transformers.packing.errors import PackingInputError
    from packed_transformers.packing.shards import PackedDataset

    from .training_helpers import make_packed

    (tmp_path / "data").mkdir()
    packed = make_packed(tmp_path / "data") / "train"
    shard = rewrite_shard(packed, change)
    if expected is None:
        PackedDataset.open(packed).check_contents(sha256=True)
        return
    with pytest.raises(PackingInputError) as caught:
        PackedDataset.open(packed).check_contents(sha256=False)
    assert str(caught.value).startswith(f"{shard}: ") and expected in str(caught.value)


# ----- 10. pretraining --resume on a checkpoint whose manifest matches damaged weights --------------
@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    from .training_helpers import make_packed

    return make_packed(tmp_path_factory.mktemp("train-data"))


def test_resume_skips_a_checkpoint_whose_weights_match_the_manifest_but_do_not_load(packed, tmp_path):
    from packed_transformers.common.files import sha256_file

    from .training_helpers import final_weights, run, write_config

    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 4, "checkpoint_every_steps": 2})
    assert run(config, tmp_path / "straight").returncode == 0
    assert run(config, tmp_path / "r").returncode == 0
    newest = sorted((tmp_path / "r" / "checkpoints").glob("step-*"))[-1]
    weights = newest / "model" / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")  # damaged, then the manifest rewritten
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["model/model.safetensors"] = {
        "bytes": weights.stat().st_size,
        "sha256": sha256_file(weights),
    }
    (newest / "manifest.json").write_text(json.dumps(manifest))
    done = run(config, tmp_path / "r", "--resume")
    assert done.returncode == 0, done.stderr
    assert "its model cannot be loaded" in done.stderr and "Traceback" not in done.stderr
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "r")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the previous checkpoint, trained on to the same end


# ----- 12. embedding routes: prompt_name on OpenAI's route, unknown fields refused ----------------
def test_embedding_routes_take_prompt_name_and_refuse_unknown_fields():
    from packed_transformers.serving.api import RequestError, RequestLimits, read_request

    limits = RequestLimits()
    request = read_request("openai", {"input": ["a"], "prompt_name": "query"}, limits, dimension=8)
    assert request.options["prompt_name"] == "query"
    assert (
        read_request("embed", {"inputs": "a", "prompt_name": "query"}, limits).options["prompt_name"]
        == "query"
    )
    for route, body in (
        ("openai", {"input": "a", "normalize": True}),
        ("embed", {"inputs": "a", "input": "b"}),
    ):
        with pytest.raises(RequestError) as caught:
            read_request(route, body, limits, dimension=8)
        assert caught.value.status == 422 and "not a field of this route" in str(caught.value)
    with pytest.raises(RequestError, match='field "prompt_name": expected a string'):
        read_request("openai", {"input": "a", "prompt_name": 3}, limits, dimension=8)


# ----- 13. messages that name the real cause -------------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_fifo_or_device_as_weights_or_shard_is_named_as_such(classifier, tmp_path, kind):
    import os

    from packed_transformers.data.classification_data import ExampleError
    from packed_transformers.door.folder import load_finetuned
    from packed_transformers.packing.errors import PackingInputError
    from packed_transformers.packing.shards import PackedDataset

    from .training_helpers import make_packed

    def plant(path):
        path.unlink()
        os.mkfifo(path) if kind == "fifo" else os.symlink("/dev/zero", path)

    folder = tmp_path / "m"
    shutil.copytree(classifier, folder)
    plant(folder / "model.safetensors")
    what = "a FIFO \\(named pipe\\)" if kind == "fifo" else "a character device"
    with pytest.raises(ExampleError, match=f"model.safetensors: is {what}, not a weights file"):
        load_finetuned(folder)
    (tmp_path / "data").mkdir()
    packed = make_packed(tmp_path / "data") / "train"
    shard = packed / json.loads((packed / "metadata.json").read_text())["shards"][0]["name"]
    plant(shard)
    with pytest.raises(
        PackingInputError, match=f"is listed in metadata.json but is {what}, not a shard file"
    ):
        PackedDataset.open(packed)


def test_a_line_without_its_text_field_says_missing_and_what_it_has(tmp_path):
    from packed_transformers.data.classification_data import ExampleError
    from packed_transformers.finetune.causal_lm_task import read_prompt_completions

    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(
        ExampleError, match=r"chat.jsonl:1: field 'prompt' is missing \(the line's fields: 'messages'\)$"
    ):
        read_prompt_completions(path, "prompt", "completion")


def test_empty_completions_without_eos_are_not_blamed_on_truncation(tmp_path, capsys):
    import yaml
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from packed_transformers.finetune import train

    from .decoder_helpers import config_for, decoder_tokenizer, tiny_config

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


# ----- 11. (low) embed does not hash the model folder's bytes on every run -------------------------
def test_embed_keys_kept_rows_on_file_identity_without_reading_the_weights(classifier, tmp_path, monkeypatch):
    from packed_transformers.commands import embed as embed_command
    from packed_transformers.common import files as common_files

    model = tmp_path / "model"
    shutil.copytree(classifier, model)
    (model / "extra.safetensors").write_bytes(b"\0" * (1 << 20))  # read by a content hash
    hashed = []
    real = common_files.sha256_file
    monkeypatch.setattr(
        common_files, "sha256_file", lambda path, *a: hashed.append(str(path)) or real(path, *a)
    )
    source = input_file(tmp_path / "in.jsonl", ["a text", "another"])
    argv = ["--model", str(model), "--input", str(source), "--output", str(tmp_path / "e.npy"), "--pooling", "mean",
            "--quiet"]  # fmt: skip
    assert embed_command.main(argv) == 0
    assert not [p for p in hashed if p.startswith(str(model))], hashed
    before = common_files.model_files_identity(model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # the same bytes saved again: a new identity (mtime)
    assert common_files.model_files_identity(model) != before


# ----- 7. the server bounds request heads in size and time ----------------------------------------
def raw_client(port: int):
    import socket

    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    return sock


def read_all(sock) -> bytes:
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.slow  # a real uvicorn server, clients over loopback, a timeout to wait out
def test_hostile_heads_are_refused_and_other_clients_answered_within_a_second(classifier):
    import threading
    import time

    import httpx

    from packed_transformers.serving.headers import HeadLimits, bounded_protocol

    from .servers import Server

    limits = HeadLimits(max_bytes=16 * 1024, timeout_s=2.0)
    with Server(classifier, http=bounded_protocol(limits)) as server:
        # 1. one client streaming a 200 MB header: 431 after the limit, never the whole stream
        big = raw_client(server.port)
        answer = {}

        def stream_header():
            big.sendall(b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            sent = 0
            try:
                while sent < 200 << 20:
                    big.sendall(b"a" * (1 << 16))
                    sent += 1 << 16
            except OSError:
                pass
            answer["sent"] = sent
            answer["reply"] = read_all(big)

        streamer = threading.Thread(target=stream_header)
        streamer.start()
        # 2. 100 clients trickling a head a byte at a time
        tricklers = [raw_client(server.port) for _ in range(100)]
        for sock in tricklers:
            sock.sendall(b"P")
        started = time.monotonic()
        latencies = []
        while time.monotonic() - started < 3.0:
            t0 = time.monotonic()
            reply = httpx.post(server.url + "/predict", json={"inputs": "a small request"}, timeout=10)
            latencies.append(time.monotonic() - t0)
            assert reply.status_code == 200, reply.text
        streamer.join(60)
        assert answer["reply"].startswith(b"HTTP/1.1 431") and answer["sent"] < 200 << 20
        refused = [read_all(sock) for sock in tricklers]  # the deadline has passed: each refused, closed
        assert all(r.startswith(b"HTTP/1.1 408") for r in refused), refused[:2]
        assert max(latencies) < 1.0, latencies
        # a normal client on a kept-alive connection is not timed out between requests
        with httpx.Client(base_url=server.url) as client:
            assert client.post("/predict", json={"inputs": "one"}).status_code == 200
            time.sleep(2.5)
            assert client.post("/predict", json={"inputs": "two"}).status_code == 200


def read_response(sock) -> bytes:
    """One HTTP/1.1 response from a kept-alive connection: its head, then content-length bytes."""
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = sock.recv(65536)
        assert chunk, reply
        reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, reply
        body += chunk
    return head + b"\r\n\r\n" + body


@pytest.mark.slow  # a real uvicorn server
def test_a_head_over_the_limit_is_refused_even_when_it_arrives_in_one_read(classifier):
    """--max-header-bytes 2048: heads of 4 KB and 100 KB sent whole get 431 (they got 200: the
    head was parsed and handed to the app within one read before it was counted); a request
    whose body arrives in the same read as its head, and the next request on that kept-alive
    connection, are answered (a body is not head), also when the blank line ending the head is
    split over two reads (it was refused 431: the second read was counted whole as head)."""
    import json
    import time

    from packed_transformers.serving.headers import HeadLimits, bounded_protocol

    from .servers import Server

    body = json.dumps(
        {"inputs": "a small request " * 200, "truncate": True}
    ).encode()  # 3.2 KB: over the head limit
    request = (
        b"POST /predict HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
    )
    with Server(classifier, http=bounded_protocol(HeadLimits(max_bytes=2048, timeout_s=5.0))) as server:
        for size in (4 << 10, 100 << 10):
            sock = raw_client(server.port)
            sock.sendall(b"POST /predict HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * size + b"\r\n\r\n")
            assert read_all(sock).startswith(b"HTTP/1.1 431"), size
        sock = raw_client(server.port)
        for _ in range(2):  # one read each: head and body together; then again on the same connection
            sock.sendall(request % (len(body), body))
            reply = read_response(sock)
            assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
        # the blank line that ends the head split over two reads, the body after it in the second
        whole = request % (len(body), body)
        cut = whole.index(b"\r\n\r\n") + 3
        sock.sendall(whole[:cut])
        time.sleep(0.2)  # two reads on the server's side
        sock.sendall(whole[cut:])
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        sock.close()


def test_the_server_command_takes_the_head_limits():
    from packed_transformers.serving import cli

    assert cli.main(["--model", "x", "--max-header-bytes", "0"]) == 2
    assert cli.main(["--model", "x", "--header-timeout-s", "0"]) == 2
