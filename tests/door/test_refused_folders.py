"""Model folders the door refuses in one line on every path: pickled weights, non-finite weights,
weights that are not the config's model, configs transformers would trip on, FIFOs and devices
where weights should be."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from ..conftest import REPO
from ..folder_helpers import (  # noqa: F401
    input_file,
    one_line_error,
    roberta_over_bert,
    run_module,
    tiny_hub_classifier,
    variant,
    with_weight,
)
from ..servers import free_port


@pytest.mark.slow  # a whole command in a fresh interpreter
def test_pickled_weights_are_refused_in_one_line_everywhere(tmp_path):
    import json

    import torch

    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    torch.save({"weight": torch.zeros(2)}, folder / "pytorch_model.bin")
    texts = tmp_path / "t.jsonl"
    texts.write_text('{"text": "a"}\n')
    for argv in (
        [
            "packed_transformers.finetune.embed",
            "--model",
            folder,
            "--pooling",
            "mean",
            "--input",
            texts,
            "--output",
            tmp_path / "e.npy",
        ],
        ["serving", "--model", folder, "--pooling", "mean", "--port", str(free_port())],
    ):
        assert "pytorch_model.bin (a pickle, which is never loaded here)" in one_line_error(run_module(*argv))


# ----- 1. (high) non-finite weights are never run --------------------------------------------------
@pytest.mark.parametrize("value, what", [(float("nan"), "NaN"), (float("inf"), "inf")])
def test_a_folder_with_a_non_finite_weight_is_refused_by_every_door(hub_classifier, tmp_path, value, what):
    from packed_transformers.data.classification_data import ExampleError
    from packed_transformers.door.folder import load_finetuned
    from packed_transformers.inference.embedding import load_encoder

    folder = with_weight(hub_classifier, tmp_path / "broken", "classifier.weight", value)
    with pytest.raises(ExampleError, match=rf"model\.safetensors: weight classifier\.weight holds {what}"):
        load_finetuned(folder)
    encoder = with_weight(
        hub_classifier, tmp_path / "broken_encoder", "bert.embeddings.word_embeddings.weight", value
    )
    with pytest.raises(ExampleError, match=rf"weight bert\.embeddings\.word_embeddings\.weight holds {what}"):
        load_encoder(encoder, pooling="mean")


@pytest.mark.slow  # three commands in fresh interpreters
def test_predict_embed_and_the_server_refuse_nan_weights_in_one_line(hub_classifier, tmp_path):
    folder = with_weight(hub_classifier, tmp_path / "broken", "classifier.weight", float("nan"))
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
        hub_classifier, tmp_path / "enc", "bert.encoder.layer.0.output.dense.weight", float("nan")
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


# ----- 10. pretraining --resume on a checkpoint whose manifest matches damaged weights --------------
# ----- 13. messages that name the real cause -------------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_fifo_or_device_as_weights_or_shard_is_named_as_such(hub_classifier, tmp_path, kind):
    import os

    from packed_transformers.data.classification_data import ExampleError
    from packed_transformers.door.folder import load_finetuned
    from packed_transformers.packing.shards import PackedDataset
    from packed_transformers.packs.errors import PackingInputError

    from ..training_helpers import make_packed

    def plant(path):
        path.unlink()
        os.mkfifo(path) if kind == "fifo" else os.symlink("/dev/zero", path)

    folder = tmp_path / "m"
    shutil.copytree(hub_classifier, folder)
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


# ----- 1, 16. config and weights of different models: one line, never random weights ----------
@pytest.mark.parametrize(
    "name, edit, drop, expected",
    [
        ("roberta_config", roberta_over_bert, (), "encoder weights of the model are not in the file"),
        ("no_classifier", None, ("classifier.",), "the model's head is not in the file (classifier.bias"),
        (
            "fewer_layers",
            lambda c: c.update(num_hidden_layers=1),
            (),
            "encoder weights in the file are not used",
        ),
        (
            "other_shape",
            lambda c: c.update(intermediate_size=48),
            (),
            "weight bert.encoder.layer.0.intermediate.dense.bias has shape [64] in the file but [48] in the model",
        ),
    ],
)
def test_a_folder_whose_weights_are_not_its_configs_model_is_refused(
    hub_classifier, tmp_path, name, edit, drop, expected
):
    from packed_transformers.data.classification_data import ExampleError
    from packed_transformers.door.folder import load_finetuned

    folder = variant(hub_classifier, tmp_path / name, edit, drop)
    with pytest.raises(ExampleError) as refused:
        load_finetuned(folder)
    message = str(refused.value)
    assert expected in message and "\n" not in message, message


@pytest.mark.slow  # the real command, in a fresh interpreter
def test_predict_refuses_a_roberta_config_over_bert_weights_in_one_line(hub_classifier, tmp_path):
    folder = variant(hub_classifier, tmp_path / "m", roberta_over_bert)
    source = input_file(tmp_path / "in.jsonl", ["a text"])
    done = run_module(
        "packed_transformers.finetune.predict",
        "--model",
        folder,
        "--input",
        source,
        "--output",
        tmp_path / "o.jsonl",
    )
    assert "encoder weights of the model are not in the file" in one_line_error(done)
    assert not (tmp_path / "o.jsonl").exists()


# ----- 9. config values transformers would trip on: one line before loading -----------------------
@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda c: c.update(hidden_size="32"), "key 'hidden_size' must be an integer >= 1, got '32'"),
        (lambda c: c.update(vocab_size=None), "key 'vocab_size' must be an integer >= 1, got None"),
        (
            lambda c: c.update(num_attention_heads=0),
            "key 'num_attention_heads' must be an integer >= 1, got 0",
        ),
        (lambda c: c.update(num_hidden_layers=-1), "key 'num_hidden_layers' must be an integer >= 1, got -1"),
        (
            lambda c: c.update(num_attention_heads=3),
            "key 'hidden_size' (32) must be a multiple of 'num_attention_heads'",
        ),
        (lambda c: c.update(vocab_size=100), "key 'vocab_size' is 100, but the folder's tokenizer has"),
    ],
)
def test_config_values_transformers_would_trip_on_are_one_line(hub_classifier, tmp_path, edit, expected):
    from packed_transformers.data.classification_data import ExampleError
    from packed_transformers.door.folder import load_finetuned
    from packed_transformers.inference.embedding import load_encoder

    folder = variant(hub_classifier, tmp_path / "m", edit)
    if "vocab_size' is 100" in expected:  # the table must still fit the weights: cut it too
        from safetensors.torch import load_file, save_file

        weights = load_file(folder / "model.safetensors")
        name = "bert.embeddings.word_embeddings.weight"
        weights[name] = weights[name][:100].clone()
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    for load in (load_finetuned, lambda f: load_encoder(f, pooling=["mean"])):
        with pytest.raises(ExampleError) as refused:
            load(folder)
        assert expected in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
