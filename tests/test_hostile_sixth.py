"""The sixth hostile test (issue: reliability 6): folders whose config and weights disagree,
a cased vocab.txt-only folder, kept embeddings of a model changed in place, two runs on one
output, links and FIFOs at a temporary name, an output into a Hugging Face cache's blobs, an
empty API key, and loopback behind --allowed-hosts. Each test fails without its fix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from .conftest import REPO
from .folder_helpers import one_line_error, run_module, tiny_hub_classifier


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny BERT classifier folder as transformers saves it (tokenizer.json, safetensors)."""
    return tiny_hub_classifier(tmp_path_factory.mktemp("sixth") / "classifier")


def variant(classifier, where, edit_config=None, drop_weights=()):
    """A copy of the classifier folder with config.json edited and/or weights removed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(classifier, where)
    if edit_config is not None:
        config = json.loads((where / "config.json").read_text())
        edit_config(config)
        (where / "config.json").write_text(json.dumps(config))
    if drop_weights:
        weights = load_file(where / "model.safetensors")
        kept = {k: v for k, v in weights.items() if not k.startswith(drop_weights)}
        save_file(kept, where / "model.safetensors", metadata={"format": "pt"})
    return where


def input_file(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


# ----- 1, 16. config and weights of different models: one line, never random weights ----------
def roberta_over_bert(config):
    config.update(model_type="roberta", architectures=["RobertaForSequenceClassification"])


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
    classifier, tmp_path, name, edit, drop, expected
):
    from packed_transformers.data.classification_data import ExampleError
    from packed_transformers.door.folder import load_finetuned

    folder = variant(classifier, tmp_path / name, edit, drop)
    with pytest.raises(ExampleError) as refused:
        load_finetuned(folder)
    message = str(refused.value)
    assert expected in message and "\n" not in message, message


@pytest.mark.slow  # the real command, in a fresh interpreter
def test_predict_refuses_a_roberta_config_over_bert_weights_in_one_line(classifier, tmp_path):
    folder = variant(classifier, tmp_path / "m", roberta_over_bert)
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


def test_fine_tuning_may_start_a_new_head_but_never_a_random_encoder(classifier, tmp_path):
    """finetune.train's loading (new_head=True): a bare encoder gets its classifier; weights of
    another family (or fewer layers) are refused, not fine-tuned from random."""
    from packed_transformers.model.bert_heads import PackedBertForSequenceClassification
    from packed_transformers.model.family_model import PackedFamilyModel

    bare = variant(classifier, tmp_path / "bare", drop_weights=("classifier.",))
    model = PackedBertForSequenceClassification.from_pretrained(bare, num_labels=3, new_head=True)
    assert model.classifier.weight.shape[0] == 3
    roberta = variant(classifier, tmp_path / "roberta", roberta_over_bert)
    with pytest.raises(ValueError, match="encoder weights of the model are not in the file"):
        PackedFamilyModel.from_pretrained(roberta, "classification", new_head=True, num_labels=2)
    fewer = variant(classifier, tmp_path / "fewer", lambda c: c.update(num_hidden_layers=1))
    with pytest.raises(ValueError, match="encoder weights in the file are not used"):
        PackedBertForSequenceClassification.from_pretrained(fewer, num_labels=2, new_head=True)


# ----- 2. a cased vocab.txt-only folder keeps its case, as transformers does ---------------------
def test_a_cased_vocab_txt_folder_is_tokenized_as_transformers_does(tmp_path):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from packed_transformers.door.folder import load_finetuned, open_tokenizer

    folder = tmp_path / "cased"
    folder.mkdir()
    words = ["New", "York", "new", "york", "is", "big", "ne", "##w", "y", "##ork", "N", "##ew", "Y", "##ork"]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(words)]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"do_lower_case": False, "tokenizer_class": "BertTokenizer"})
    )
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2)  # fmt: skip
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    assert not (folder / "tokenizer.json").exists()
    text = "New York is big"
    expected = AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    assert load_finetuned(folder).tokenizer.encode(text).ids == expected
    assert open_tokenizer(folder).tokenizer.encode(text).ids == expected
    assert expected[1:3] == [vocab.index("New"), vocab.index("York")]  # the case is kept


# ----- 3, 4, 5, 6. commands.embed's kept work, lock, temporary name and output ------------------
def interrupted_after_one_chunk():
    """commands.embed's iter_encode that raises KeyboardInterrupt (Ctrl-C) after its first chunk."""
    from packed_transformers.inference import embedding

    real = embedding.iter_encode

    def stop_after_one_chunk(*args, **kwargs):
        for i, chunk in enumerate(real(*args, **kwargs)):
            if i == 1:
                raise KeyboardInterrupt
            yield chunk

    return stop_after_one_chunk


def embed_argv(model, source, output):
    return [
        "--model",
        str(model),
        "--input",
        str(source),
        "--output",
        str(output),
        "--pooling",
        "mean",
        "--quiet",
    ]


def test_kept_rows_of_a_model_changed_in_place_are_not_continued(classifier, tmp_path, monkeypatch):
    """Interrupted after its first chunk, the folder then re-saved with other weights: the
    rerun computes every row with the new model (it had mixed old and new rows)."""
    from packed_transformers.commands import embed as embed_command
    from packed_transformers.inference import embedding

    model = tmp_path / "model"
    shutil.copytree(classifier, model)
    texts = [f"text number {i} about london" for i in range(40)]
    source = input_file(tmp_path / "in.jsonl", texts)
    output = tmp_path / "e.npy"
    real, stop_after_one_chunk = embedding.iter_encode, interrupted_after_one_chunk()

    monkeypatch.setattr(embed_command, "iter_encode", stop_after_one_chunk)
    assert embed_command.main([*embed_argv(model, source, output), "--chunk-texts", "8"]) != 0
    assert (tmp_path / ".e.npy.partial").is_file()  # rows kept for a rerun
    monkeypatch.setattr(embed_command, "iter_encode", real)
    from safetensors.torch import load_file, save_file

    weights = load_file(model / "model.safetensors")
    weights = {k: v * 1.5 if v.dtype.is_floating_point else v for k, v in weights.items()}
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})  # a new revision in place
    assert embed_command.main([*embed_argv(model, source, output), "--chunk-texts", "8"]) == 0
    fresh = tmp_path / "fresh.npy"
    assert embed_command.main([*embed_argv(model, source, fresh), "--chunk-texts", "8"]) == 0
    np.testing.assert_allclose(np.load(output), np.load(fresh), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # two real processes
def test_a_second_run_on_the_same_output_is_refused_while_the_first_runs(classifier, tmp_path):
    source = input_file(tmp_path / "in.jsonl", ["one text", "another text"])
    output = tmp_path / "e.npy"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from packed_transformers.common.files import lock_folder; "
         f"lock_folder({str(output)!r}, 'finetune.embed writing this output'); print('held', flush=True); time.sleep(60)"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        done = run_module("packed_transformers.finetune.embed", *embed_argv(classifier, source, output))
        assert "in use by another finetune.embed" in one_line_error(done)
        assert not output.exists() and not (tmp_path / ".e.npy.partial").exists()
    finally:
        holder.kill()
        holder.wait()
    done = run_module("packed_transformers.finetune.embed", *embed_argv(classifier, source, output))
    assert done.returncode == 0, done.stderr
    assert np.load(output).shape[0] == 2


def test_a_link_or_fifo_at_the_temporary_name_is_never_followed(classifier, tmp_path):
    from packed_transformers.commands import embed as embed_command

    source = input_file(tmp_path / "in.jsonl", ["one text", "another text"])
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / ".e.npy.partial").symlink_to(victim)
    assert embed_command.main(embed_argv(classifier, source, tmp_path / "e.npy")) == 2
    assert victim.read_text() == "precious" and not (tmp_path / "e.npy").exists()
    os.mkfifo(tmp_path / ".f.npy.partial")
    started = time.monotonic()
    assert embed_command.main(embed_argv(classifier, source, tmp_path / "f.npy")) == 2
    assert time.monotonic() - started < 60 and (tmp_path / ".f.npy.partial").is_fifo()


def test_an_output_into_a_hub_cache_snapshot_or_its_blobs_is_refused(classifier, tmp_path, capsys):
    """The cache layout: snapshots/REV/FILE -> ../../blobs/HASH. An output naming a snapshot
    file, or any path in blobs, would replace a cached model's file."""
    from packed_transformers.commands import embed as embed_command
    from packed_transformers.common.files import sha256_file

    repo = tmp_path / "hub" / "models--someone--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in classifier.iterdir():
        blob = blobs / sha256_file(file)
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    weights_blob = (snapshot / "model.safetensors").resolve()
    before = weights_blob.read_bytes()
    source = input_file(tmp_path / "in.jsonl", ["one text"])
    for output in (snapshot / "model.safetensors", blobs / "vectors.npy"):
        assert embed_command.main(embed_argv(snapshot, source, output)) == 2
        assert "which this command reads" in capsys.readouterr().err
    assert weights_blob.read_bytes() == before and not (blobs / "vectors.npy").exists()
    assert embed_command.main(embed_argv(snapshot, source, tmp_path / "ok.npy")) == 0  # the cache is usable


# ----- 7, 8. the server's key and its own machine ---------------------------------------------------
@pytest.mark.parametrize("how", ["flag", "environment", "blank"])
def test_an_empty_api_key_is_refused_at_start(tmp_path, how):
    env = {k: v for k, v in os.environ.items() if k != "API_KEY"}
    argv = [
        sys.executable,
        "-m",
        "packed_transformers.serving",
        "--model",
        str(tmp_path),
        "--port",
        "1",
    ]  # any folder: refused first
    if how == "flag":
        argv += ["--api-key", ""]
    elif how == "environment":
        env["API_KEY"] = ""
    else:
        argv += ["--api-key", "   "]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert "an empty key would leave the server without authentication" in one_line_error(done)


def test_loopback_clients_keep_loopback_names_under_allowed_hosts():
    from packed_transformers.serving.access import AccessRules, refusal

    named = AccessRules.for_bind("0.0.0.0", allowed_hosts=["api.example.com"])
    assert refusal(named, "GET", "/ready", {"host": "localhost:8080"}, client="127.0.0.1") is None
    assert refusal(named, "GET", "/ready", {"host": "127.0.0.1:8080"}, client="::ffff:127.0.0.1") is None
    assert refusal(named, "POST", "/predict", {"host": "api.example.com"}, client="10.1.2.3") is None
    # a rebound web page names its own domain, loopback client or not; others may not say localhost
    assert refusal(named, "POST", "/predict", {"host": "evil.example"}, client="127.0.0.1")[0] == 421
    assert refusal(named, "GET", "/ready", {"host": "localhost"}, client="10.1.2.3")[0] == 421
    bound = AccessRules.for_bind("192.168.1.5", allowed_hosts=["api.example.com"])
    assert refusal(bound, "GET", "/ready", {"host": "192.168.1.5:80"}, client="10.1.2.3") is None
    assert refusal(bound, "GET", "/ready", {"host": "localhost"}, client="127.0.0.1") is None


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
def test_config_values_transformers_would_trip_on_are_one_line(classifier, tmp_path, edit, expected):
    from packed_transformers.data.classification_data import ExampleError
    from packed_transformers.door.folder import load_finetuned
    from packed_transformers.inference.embedding import load_encoder

    folder = variant(classifier, tmp_path / "m", edit)
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


# ----- 14. finetune.train --resume on a damaged checkpoint, or on changed data ---------------------
@pytest.mark.slow  # a stopped fine-tuning run per case
@pytest.mark.parametrize("damage", ["model.safetensors", "training_state.pt", "progress.json", "train data"])
def test_resume_refuses_a_damaged_checkpoint_or_changed_data_in_one_line(tmp_path, damage):
    from packed_transformers.data.assets import model_dir
    from packed_transformers.finetune import train as finetune
    from packed_transformers.finetune.config import load_finetune_config

    from .finetune_helpers import StopAfter, write_config

    config = load_finetune_config(str(write_config(tmp_path, model_dir(), training={"epochs": 2})), [])
    with pytest.raises(finetune.Interrupted):
        finetune.run_finetune(config, tmp_path / "run", stop=StopAfter(3))
    if damage == "train data":  # other rows at the same path
        train = tmp_path / "train.jsonl"
        lines = train.read_text().splitlines()
        train.write_text("\n".join(reversed(lines)) + "\n")
        expected = "the training or validation data changed since the checkpoint"
    else:
        path = tmp_path / "run" / "checkpoint" / damage
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])  # cut in half
        expected = "damaged"
    with pytest.raises(finetune.FinetuneError) as refused:
        finetune.run_finetune(config, tmp_path / "run", resume=True)
    assert expected in str(refused.value) and "--overwrite" in str(refused.value), str(refused.value)


def test_a_damaged_record_of_kept_rows_starts_over(classifier, tmp_path, monkeypatch):
    """An interrupted run's .NAME.partial.json edited to rows_written -1, 1.5 or "3" (the
    rest of the record intact): the rows are not trusted, the run starts over and writes
    every row (it was a traceback or a repeated error)."""
    from packed_transformers.commands import embed as embed_command
    from packed_transformers.inference import embedding

    texts = [f"text number {i}" for i in range(24)]
    source = input_file(tmp_path / "in.jsonl", texts)
    reference = tmp_path / "reference.npy"
    assert embed_command.main([*embed_argv(classifier, source, reference), "--chunk-texts", "8"]) == 0
    real, stop_after_one_chunk = embedding.iter_encode, interrupted_after_one_chunk()

    output = tmp_path / "e.npy"
    record = tmp_path / ".e.npy.partial.json"
    for bad in (-1, 1.5, "3"):
        monkeypatch.setattr(embed_command, "iter_encode", stop_after_one_chunk)
        assert embed_command.main([*embed_argv(classifier, source, output), "--chunk-texts", "8"]) != 0
        state = json.loads(record.read_text())
        assert state["rows_written"] == 8
        record.write_text(json.dumps({**state, "rows_written": bad}))
        monkeypatch.setattr(embed_command, "iter_encode", real)
        assert embed_command.main([*embed_argv(classifier, source, output), "--chunk-texts", "8"]) == 0
        np.testing.assert_allclose(np.load(output), np.load(reference), rtol=1e-5, atol=1e-6)
        output.unlink()


# ----- 12. a cold server bounds admission by a first measured estimate -----------------------------
class LinearEngine:
    """A model double: 10 ms plus 20 us per token (50,000 tokens/s at full batches); its
    first estimate (as serving/engines.py's engines give one) is a conservative 20,000."""

    task = "classification"

    def cold_tokens_per_second(self):
        return 20_000.0

    def run(self, token_ids, segment_ids, table, width):
        time.sleep(0.01 + 2e-5 * sum(len(t) for t in token_ids))
        return [len(t) for t in token_ids]


def test_a_burst_on_a_cold_server_is_refused_rather_than_left_to_time_out():
    """40 requests of 8 x 512 tokens at once, 1 s timeout: about 4 s of work. A cold server
    had no estimate, admitted them all and answered most with 504 after the wait; the engine's
    first estimate now refuses (429) what cannot run in time, and every admitted one answers."""
    import asyncio

    from packed_transformers.serving.metrics import ServerMetrics
    from packed_transformers.serving.policies import PolicySettings
    from packed_transformers.serving.scheduler import QueueFull, QueueLimits, Scheduler, TicketFailed

    async def scenario():
        scheduler = Scheduler(
            LinearEngine(), PolicySettings("packed", max_length=512, max_batch_tokens=4096),
            QueueLimits(1024, 0, 1.0), ServerMetrics(),
        )  # fmt: skip
        scheduler.start()
        admitted, refused = [], 0
        for _ in range(40):
            try:
                admitted.append(scheduler.submit([np.zeros(512)] * 8, [None] * 8).future)
            except QueueFull:
                refused += 1
        outcomes = []
        for future in admitted:
            try:
                outcomes.append(await future)
            except TicketFailed as failed:
                outcomes.append(failed.status)
        scheduler.stop()
        return refused, outcomes

    refused, outcomes = asyncio.run(scenario())
    assert refused >= 25, refused  # at most ~0.5 s of the 4 s admitted
    assert outcomes and all(o == [512] * 8 for o in outcomes), outcomes  # no 504 among the admitted
