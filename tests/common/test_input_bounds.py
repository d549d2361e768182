"""Inputs with no end of line and inputs given twice (issue 84): every command's JSON-lines
reader (packed_transformers.data.classification_data.bounded_lines) refuses a line past MAX_LINE_BYTES naming
file:line, with memory bounded by the limit; pack-documents refuses one file named twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from packed_transformers.commands.embed import count_lines, read_texts
from packed_transformers.data.classification_data import MAX_LINE_BYTES, bounded_lines, read_jsonl
from packed_transformers.data.documents import read_documents
from packed_transformers.data.text_rule import ExampleError

from ..conftest import REPO

READERS = {
    "pack-documents / train-tokenizer": lambda path: read_documents([path]),
    "predict / train": lambda path: read_jsonl(path, "text", None, None, need_labels=False),
    "embed (count)": lambda path: count_lines(path, "text"),
    "embed (texts)": lambda path: list(read_texts(path, "text")),
}


@pytest.mark.parametrize("reader", list(READERS))
def test_an_endless_line_is_refused_naming_file_and_line_with_bounded_memory(reader):
    tracemalloc.start()
    try:
        with pytest.raises(ExampleError, match=r"^/dev/zero:1: a line of more than [\d,]+ bytes") as err:
            READERS[reader](Path("/dev/zero"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "\n" not in str(err.value)
    assert peak < 3 * MAX_LINE_BYTES, peak  # a read of the limit (and its decode), not of the input


def test_lines_under_the_limit_read_as_before_and_the_limit_is_exact(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "b"}')  # the last line without its newline
    with path.open("rb") as f:
        assert [n for n, _ in bounded_lines(f, str(path))] == [1, 2]
    assert read_documents([path]).texts == ["a", "b"]
    path.write_bytes(b"x" * 10 + b"\n" + b"y" * 12)
    with path.open("rb") as f:
        lines = bounded_lines(f, str(path), limit=11)
        assert next(lines) == (1, b"x" * 10 + b"\n")  # 11 bytes with the newline: at the limit
        with pytest.raises(ExampleError, match=":2: a line of more than 11 bytes"):
            next(lines)


@pytest.mark.slow  # a command in a fresh interpreter
def test_pack_documents_refuses_dev_zero_and_a_file_named_twice(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(5)))
    os.symlink(docs, tmp_path / "link.jsonl")
    from packed_transformers.data import train_tokenizer

    assert (
        train_tokenizer.main(["--input", str(docs), "--vocab-size", "280", "--output", str(tmp_path / "tok")])
        == 0
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for inputs, expected in (
        ([docs, docs], f"--input {docs} is the same file as --input {docs}"),
        (
            [docs, tmp_path / "link.jsonl"],
            f"--input {tmp_path / 'link.jsonl'} is the same file as --input {docs}",
        ),
        (["/dev/zero"], "/dev/zero:1: a line of more than"),
    ):
        argv = ["--input", *map(str, inputs)]
        done = subprocess.run(
            [sys.executable, "-m", "packed_transformers", "pack-documents", *argv, "--tokenizer", str(tmp_path / "tok"),
             "--output", str(tmp_path / "out")],
            cwd=REPO, capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and expected in lines[0], done.stderr[-2000:]
        assert not (tmp_path / "out").exists()


def test_a_sequence_length_past_the_bound_is_refused_where_it_is_given(tmp_path):
    from packed_transformers.commands import pack_documents
    from packed_transformers.hf_integration.trainer import PackedDatasetError, pack_dataset
    from packed_transformers.packs.errors import PackingInputError
    from packed_transformers.packs.histogram import MAX_SEQUENCE_LENGTH, Histogram

    rows = [{"input_ids": [1, 2, 3], "label": 0}]
    with pytest.raises(
        PackedDatasetError, match="max_sequence_length must be at most 1,048,576 tokens, got 1,000,000,000"
    ):
        pack_dataset(rows, task="single_label_classification", max_sequence_length=10**9)
    with pytest.raises(PackingInputError, match="at most 1,048,576"):
        Histogram.from_lengths([3, 4], 10**9)
    assert Histogram.from_lengths([3, 4], MAX_SEQUENCE_LENGTH).max_sequence_length == MAX_SEQUENCE_LENGTH
    docs = tmp_path / "d.jsonl"
    docs.write_text('{"text": "a b"}\n')
    code = pack_documents.main(["--input", str(docs), "--tokenizer", str(tmp_path), "--output", str(tmp_path / "o"),
                                "--max-sequence-length", str(10**9)])  # fmt: skip
    assert code == 2 and not (tmp_path / "o").exists()


# ----- integers past Python's digit limit (common.input_limits.MAX_INT_DIGITS) ------------------
HUGE = "9" * 5000  # int("9" * 5000) raises a bare ValueError in Python >= 3.11


@pytest.mark.parametrize("reader", [r for r in READERS if r != "embed (count)"])  # counting parses nothing
@pytest.mark.parametrize("where", ["text", "other"])
def test_an_integer_of_5000_digits_in_a_json_line_is_one_line_naming_file_and_line(tmp_path, reader, where):
    path = tmp_path / "in.jsonl"
    line = '{"text": ' + HUGE + "}" if where == "text" else '{"text": "a", "n": ' + HUGE + "}"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(
        ExampleError, match=rf"^{path}:2: not valid JSON \(an integer of more than 4300 digits\)$"
    ):
        list(READERS[reader](path)) if "texts" in reader else READERS[reader](path)


def test_the_server_answers_422_to_an_integer_of_5000_digits():
    from packed_transformers.serving.api import RequestError, RequestLimits, read_json

    with pytest.raises(RequestError) as caught:
        read_json(('{"inputs": "a", "truncate": ' + HUGE + "}").encode(), RequestLimits())
    assert caught.value.status == 422 and "an integer of more than 4300 digits" in str(caught.value)


def test_a_config_or_set_with_an_integer_of_5000_digits_is_one_line_naming_file_and_line(tmp_path):
    from packed_transformers.common.config_schema import ConfigError, apply_overrides, read_yaml
    from packed_transformers.training.config import SCHEMA

    config = tmp_path / "c.yaml"
    config.write_text("training:\n  max_steps: " + HUGE + "\n")
    with pytest.raises(ConfigError, match=rf"^{config}: an integer of more than 4300 digits \(line 2\)"):
        read_yaml(config)
    with pytest.raises(ConfigError, match=r"^--set training.max_steps: an integer of more than 4300 digits"):
        apply_overrides({}, ["training.max_steps=" + HUGE], SCHEMA)


def test_a_command_given_a_5000_digit_integer_exits_2_in_one_line(tmp_path):
    """Through a real command (embed): exit 2, one line on stderr, no traceback, no output."""
    from packed_transformers.data.assets import model_dir

    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "a", "id": ' + HUGE + "}\n")
    out = tmp_path / "out.npy"
    done = subprocess.run(
        [sys.executable, "-m", "packed_transformers", "embed", "--model", str(model_dir()), "--input", str(source),
         "--output", str(out)], capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    said = [line for line in done.stderr.splitlines() if line.strip() and "%|" not in line]  # not tqdm's bar
    assert said == [f"error: {source}:1: not valid JSON (an integer of more than 4300 digits)"], done.stderr
    assert not out.exists()


def test_every_route_refuses_a_field_it_does_not_take():
    """/rerank given another API's top_n answered every text; /predict, /qa and /tokens took
    any field too: each now answers 422 naming the field and what the route takes."""
    from packed_transformers.serving.api import RequestError, RequestLimits, read_request

    bodies = {
        "rerank": {"query": "q", "texts": ["a", "b"], "top_n": 1},
        "predict": {"inputs": "a", "top_k": 1},
        "qa": {"inputs": {"question": "q", "context": "c"}, "top_k": 2},
        "tokens": {"inputs": "a", "aggregation_strategy": "simple"},
    }
    for route, body in bodies.items():
        with pytest.raises(RequestError) as caught:
            read_request(route, body, RequestLimits())
        unknown = next(iter(set(body) - {"query", "texts", "inputs"}))
        assert caught.value.status == 422 and f'field "{unknown}": not a field of this route' in str(
            caught.value
        )
        known = {k: v for k, v in body.items() if k != unknown}
        assert read_request(route, known, RequestLimits()).route == route


# ----- messages that name the real cause ---------------------------------------------------------
def test_outputs_that_are_folders_devices_or_negative_limits_are_named_for_what_they_are(tmp_path, capsys):
    """train-tokenizer writes a folder, by pack-documents' rule (common.files.output_folder_mistake):
    an earlier tokenizer folder is replaced; a folder of other files, a file there, or an input
    inside it refused (it asked for a file path); a directory or /dev/full as an output file is
    not blamed on "no space left"; debian-texts --limit -1 is refused (it dropped the last text)."""
    import errno

    from packed_transformers.common.files import describe_os_error
    from packed_transformers.data import debian_texts, train_tokenizer

    source = tmp_path / "in.jsonl"
    source.write_text(
        "".join(json.dumps({"text": f"text number {i} of a few words"}) + "\n" for i in range(50))
    )
    folder = tmp_path / "tokenizer"
    argv = ["--input", str(source), "--vocab-size", "300", "--output"]
    assert train_tokenizer.main([*argv, str(folder)]) == 0
    (folder / "old.txt").write_text("replaced with the folder")
    assert train_tokenizer.main([*argv, str(folder)]) == 0  # an earlier output: replaced
    assert (folder / "tokenizer.json").is_file() and not (folder / "old.txt").exists()
    capsys.readouterr()
    others = tmp_path / "others"
    others.mkdir()
    (others / "mine.txt").write_text("a user's file")
    assert train_tokenizer.main([*argv, str(others)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --output {others} is a folder holding other files (no tokenizer.json of this command); "
        "give a new path"
    )
    assert (others / "mine.txt").read_text() == "a user's file"
    assert train_tokenizer.main([*argv, str(source)]) == 2
    assert capsys.readouterr().err.strip() == f"error: --output {source} exists and is not a folder"
    assert train_tokenizer.main([*argv, str(tmp_path)]) == 2
    assert f"error: --output {tmp_path} would replace or lie inside {source}" in capsys.readouterr().err
    for err in (OSError(errno.EEXIST, "is a directory; an output is written only to a regular file or a new path", "d"),
                OSError(errno.EEXIST, "is a character device; an output is written only to a regular file", "/dev/full")):  # fmt: skip
        assert "no space" not in describe_os_error(err)
    assert "no space left" in describe_os_error(OSError(None, "100 requested and 0 written", "x.npy"))
    assert debian_texts.main(["--output", str(tmp_path / "d.jsonl"), "--limit", "-1"]) == 2
    assert "--limit must be a positive number of documents, got -1" in capsys.readouterr().err
    assert not (tmp_path / "d.jsonl").exists()


def test_debian_texts_says_when_apt_gave_synopses_only(tmp_path, capsys):
    """Without `apt-get update -o Acquire::Languages=en` apt holds only *_Packages lists: the texts
    are one-line synopses, too little for the decoder recipe's 1024 evaluation rows, and the
    command says how to get the long descriptions (pack-documents' refusal later says why)."""
    from packed_transformers.data import debian_texts

    lists = tmp_path / "lists"
    lists.mkdir()
    (lists / "deb_main_binary-amd64_Packages").write_text(
        "Package: a\nDescription: first synopsis\n\nPackage: b\nDescription: second synopsis\n\n"
    )
    out = tmp_path / "d.jsonl"
    assert debian_texts.main(["--output", str(out), "--lists", str(lists)]) == 0
    assert [json.loads(line)["text"] for line in out.read_text().splitlines()] == [
        "first synopsis",
        "second synopsis",
    ]
    assert (
        "synopses only (one line each): `apt-get update -o Acquire::Languages=en`" in capsys.readouterr().err
    )
    (lists / "deb_main_i18n_Translation-en").write_text(
        "Package: a\nDescription-en: first synopsis\n long words\n\n"
    )
    assert debian_texts.main(["--output", str(out), "--lists", str(lists)]) == 0
    assert "synopses only" not in capsys.readouterr().err
