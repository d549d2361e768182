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
from .test_hostile_fifth import one_line_error, run_module, tiny_hub_classifier


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


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def input_file(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


# ----- 1. (high) non-finite weights are never run --------------------------------------------------
@pytest.mark.parametrize("value, what", [(float("nan"), "NaN"), (float("inf"), "inf")])
def test_a_folder_with_a_non_finite_weight_is_refused_by_every_door(classifier, tmp_path, value, what):
    from data.classification_data import ExampleError
    from finetune.embedding import load_encoder
    from finetune.folder import load_finetuned

    folder = with_weight(classifier, tmp_path / "broken", "classifier.weight", value)
    with pytest.raises(ExampleError, match=rf"model\.safetensors: weight classifier\.weight holds {what}"):
        load_finetuned(folder)
    encoder = with_weight(
        classifier, tmp_path / "broken_encoder", "bert.embeddings.word_embeddings.weight", value
    )
    with pytest.raises(ExampleError, match=rf"weight bert\.embeddings\.word_embeddings\.weight holds {what}"):
        load_encoder(encoder, pooling="mean")


def test_scores_that_are_not_finite_are_never_written():
    from data.classification_data import ExampleError
    from finetune.inference import prediction_records

    logits = np.array([[0.0, 1.0], [np.nan, 0.0]], dtype=np.float32)
    with pytest.raises(ExampleError, match="example 1: the model's scores are not finite"):
        list(prediction_records(logits, ["a", "b"], multi_label=False))


@pytest.mark.slow  # three commands in fresh interpreters
def test_predict_embed_and_the_server_refuse_nan_weights_in_one_line(classifier, tmp_path):
    folder = with_weight(classifier, tmp_path / "broken", "classifier.weight", float("nan"))
    source = input_file(tmp_path / "in.jsonl", ["a text", "another text"])
    done = run_module(
        "finetune.predict", "--model", folder, "--input", source, "--output", tmp_path / "o.jsonl"
    )
    assert "model.safetensors: weight classifier.weight holds NaN" in one_line_error(done)
    assert not (tmp_path / "o.jsonl").exists()
    encoder = with_weight(
        classifier, tmp_path / "enc", "bert.encoder.layer.0.output.dense.weight", float("nan")
    )
    done = run_module(
        "finetune.embed",
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
        [sys.executable, "-m", "serving", "--model", str(folder), "--port", str(free_port())],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert "weight classifier.weight holds NaN" in one_line_error(done)


def test_fine_tuning_refuses_to_start_from_non_finite_weights(classifier, tmp_path):
    from model.opening import ModelOptions, NonFiniteWeights, open_model

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

    from .test_decoders import decoder_tokenizer, tiny_config

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

    from finetune.embedding import load_encoder
    from finetune.folder import load_finetuned

    reference = AutoTokenizer.from_pretrained(qwen2_classifier)
    expected = [reference(text)["input_ids"] for text in COMBINING]
    from tokenizers import Tokenizer

    alone = Tokenizer.from_file(str(qwen2_classifier / "tokenizer.json"))
    assert [alone.encode(t).ids for t in COMBINING] != expected  # the file alone differs (the defect)
    assert [load_finetuned(qwen2_classifier).tokenizer.encode(t).ids for t in COMBINING] == expected
    ids, _ = load_encoder(qwen2_classifier, pooling="lasttoken").tokenize_texts(COMBINING, ["t"] * len(COMBINING))
    assert [list(map(int, i)) for i in ids] == expected


def test_predict_scores_equal_transformers_on_text_with_combining_marks(qwen2_classifier, tmp_path):
    import transformers
    from transformers import AutoTokenizer

    from finetune import predict

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
    from model.opening import ModelOptions, open_model

    from .test_decoders import packed_rows, tiny_config

    import transformers

    config = tiny_config("llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    model = open_model(tmp_path / "llama", "causal_lm", ModelOptions()).model
    rows, _ = packed_rows()
    out = model(**rows, labels=rows["input_ids"])
    assert out.loss is out["loss"] and out.logits is out["logits"] and out[0] is out.loss
    assert torch.isfinite(out.loss)
    assert model(**rows).loss is None
    with pytest.raises(AttributeError, match="has no output 'lossy'"):
        out.lossy  # noqa: B018
    bert = open_model(classifier, "classification", ModelOptions()).model
    head_out = bert(**{**rows, "input_ids": rows["input_ids"] % 50})
    assert head_out.logits is head_out["logits"] and head_out.loss is None
