"""config.json parsed once and transformers' tokenizer built once per run, counted on real
processes: `python -m packed_transformers predict|embed ...` as a user runs it, with an audit
hook over every open of the process (transformers' own included) and a count of tokenizer
objects built (tests/counting/sitecustomize.py); each count shown failing on a planted second
reader."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from ..decoder_helpers import decoder_tokenizer, tiny_config
from ..family_helpers import save_family_folder
from ..folder_helpers import tiny_hub_classifier
from ..house_helpers import counted_run

pytestmark = pytest.mark.slow  # fresh interpreters, as users start them


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("read_once")
    texts = root / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("a text", "another text here")))
    squad = root / "squad.jsonl"
    squad.write_text(json.dumps({"id": "q1", "question": "what text", "context": "a text about things",
                                 "answers": {"text": ["a text"], "answer_start": [0]}}) + "\n")  # fmt: skip
    tokenizer = decoder_tokenizer()
    torch.manual_seed(0)
    gpt2 = AutoModelForSequenceClassification.from_config(
        tiny_config("gpt2", num_labels=2, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id or 0)
    )
    gpt2.save_pretrained(root / "gpt2")
    tokenizer.save_pretrained(root / "gpt2")
    lm = AutoModelForCausalLM.from_config(tiny_config("gpt2", vocab_size=len(tokenizer)))
    lm.save_pretrained(root / "gpt2_lm")
    tokenizer.save_pretrained(root / "gpt2_lm")
    return {
        "bert": tiny_hub_classifier(root / "bert"),
        "gpt2": root / "gpt2",
        "gpt2_lm": root / "gpt2_lm",
        "roberta": save_family_folder(root / "roberta", "roberta", "classification"),
        "qa": save_family_folder(root / "qa", "bert", "question_answering"),
        "texts": texts,
        "squad": squad,
    }


RUNS = {  # name -> (folder, the command's arguments after the folder)
    "predict a BERT classifier": ("bert", ["predict", "--input", "texts", "--output", "p.jsonl"]),
    "predict a GPT-2 classifier": ("gpt2", ["predict", "--input", "texts", "--output", "p.jsonl"]),
    "predict a RoBERTa classifier": ("roberta", ["predict", "--input", "texts", "--output", "p.jsonl"]),
    "answer questions (QA)": ("qa", ["predict", "--input", "squad", "--output", "answers.json"]),
    "embed with a BERT": (
        "bert",
        ["embed", "--input", "texts", "--output", "e.npy", "--pooling", "mean", "--quiet"],
    ),
    "embed with a RoBERTa": (
        "roberta",
        ["embed", "--input", "texts", "--output", "e.npy", "--pooling", "mean", "--quiet"],
    ),
}


def command(folders, tmp_path, name):
    folder_key, arguments = RUNS[name]
    argv = [arguments[0], "--model", folders[folder_key]]
    for value in arguments[1:]:
        argv.append(
            folders.get(value, tmp_path / value) if not value.startswith("--") and value != "mean" else value
        )
    return folders[folder_key], argv


@pytest.mark.parametrize("name", RUNS)
def test_each_run_parses_config_json_once_and_builds_one_tokenizer(folders, tmp_path, name):
    folder, argv = command(folders, tmp_path, name)
    done, counts = counted_run(argv, folder, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert counts == {"config_json": 1, "tokenizer_builds": 1}, name


@pytest.mark.parametrize("plant, seen", [("config", {"config_json": 2, "tokenizer_builds": 1}),
                                         ("tokenizer", {"config_json": 1, "tokenizer_builds": 2})])  # fmt: skip
def test_a_planted_second_reader_is_counted(folders, tmp_path, plant, seen):
    folder, argv = command(folders, tmp_path, "predict a GPT-2 classifier")
    done, counts = counted_run(argv, folder, tmp_path, plant=plant)
    assert done.returncode == 0, done.stderr[-2000:]
    # a planted AutoTokenizer reads config.json itself, unless given it: seen as 2 there too
    assert (
        counts["tokenizer_builds"] == seen["tokenizer_builds"]
        and counts["config_json"] >= seen["config_json"]
    )


def test_fine_tuning_from_a_gpt2_checkpoint_parses_its_config_once_and_builds_one_tokenizer(
    folders, tmp_path
):
    from ..finetune_helpers import write_config

    checkpoint = folders["gpt2"]  # a family whose model asks its tokenizer about token types
    config = write_config(tmp_path, checkpoint, training={"epochs": 1, "progress": False})
    done, counts = counted_run(
        ["train", "--config", config, "--output-dir", tmp_path / "run"], checkpoint, tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert counts == {"config_json": 1, "tokenizer_builds": 1}


def test_sft_of_a_gpt2_parses_its_config_once_and_builds_one_tokenizer(folders, tmp_path):
    import yaml

    from ..decoder_helpers import config_for

    start = folders["gpt2_lm"]
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump(config_for(tmp_path, start, epochs=1)))
    done, counts = counted_run(
        ["train", "--config", config, "--output-dir", tmp_path / "run"], start, tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert counts == {"config_json": 1, "tokenizer_builds": 1}


def test_the_server_parses_config_once_and_builds_one_tokenizer(folders, tmp_path):
    """`packed serve` as a user runs it: ready, one /predict answered, stopped by SIGINT (a
    normal exit, so the counts are written)."""
    import signal
    import subprocess
    import sys

    import httpx

    from ..conftest import REPO
    from ..house_helpers import counting_environment
    from ..servers import free_port, wait_ready

    folder = folders["gpt2"]
    env, counts = counting_environment(folder, tmp_path)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "packed_transformers", "serve", "--model", str(folder),
                               "--port", str(port)], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        assert wait_ready(f"http://127.0.0.1:{port}"), "the server did not become ready"
        answer = httpx.post(f"http://127.0.0.1:{port}/predict", json={"inputs": "a text"}, timeout=60)
        assert answer.status_code == 200, answer.text
    finally:
        server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=60)
    assert server.returncode == 0, stderr[-2000:]
    assert json.loads(counts.read_text()) == {"config_json": 1, "tokenizer_builds": 1}


def test_decoder_pretraining_from_a_folder_parses_its_config_once(folders, tmp_path):
    """`packed pretrain` of a decoder from a Llama folder (model.init_checkpoint): config.json
    parsed once; pretraining reads token ids from its rows and builds no tokenizer."""
    from transformers import AutoModelForCausalLM

    from ..conftest import REPO
    from ..training_helpers import DECODER_S, decoder_rows

    start = tmp_path / "llama"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=64)).save_pretrained(start)
    decoder_rows(tmp_path / "train")
    decoder_rows(tmp_path / "eval", seed=1)
    settings = [f"data.train_dir={tmp_path / 'train'}", f"data.eval_dir={tmp_path / 'eval'}",
                f"data.max_sequence_length={DECODER_S}", "eval.rows=2", "training.max_steps=1",
                "eval.every_samples=4", f"model.init_checkpoint={start}"]  # fmt: skip
    argv = [
        "pretrain",
        "--config",
        REPO / "configs/pretrain_decoder_tiny.yaml",
        "--output-dir",
        tmp_path / "run",
    ]
    done, counts = counted_run([*argv, *(a for s in settings for a in ("--set", s))], start, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert counts == {"config_json": 1, "tokenizer_builds": 0}
