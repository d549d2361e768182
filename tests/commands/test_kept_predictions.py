"""`packed predict` keeps its predictions chunk by chunk (issue 110 item 3): Ctrl-C keeps every
chunk written, the same command continues after them to the same file an uninterrupted run
writes, another input starts over, and the one-line message says what was kept."""

from __future__ import annotations

import json

import pytest

from ..folder_helpers import input_file

TEXTS = [f"text number {i} " + "word " * (i % 7) for i in range(23)]


def predict_argv(model, source, output, *extra):
    return ["--model", str(model), "--input", str(source), "--output", str(output), "--quiet",
            "--chunk-texts", "5", "--chunk-seconds", "0", *extra]  # fmt: skip


def stopped_after(chunks: int):
    """kept_predictions' iter_classify that raises KeyboardInterrupt (Ctrl-C) after `chunks` chunks."""
    from packed_transformers.inference.classify import iter_classify

    def stop(*args, **kwargs):
        for i, chunk in enumerate(iter_classify(*args, **kwargs)):
            if i == chunks:
                raise KeyboardInterrupt
            yield chunk

    return stop


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_interrupted_predict_keeps_its_chunks_and_the_rerun_continues(hub_classifier, tmp_path, monkeypatch,
                                                                         capsys):  # fmt: skip
    from packed_transformers.commands import kept_predictions, predict

    source = input_file(tmp_path / "in.jsonl", TEXTS)
    whole = tmp_path / "whole.jsonl"
    assert predict.main(predict_argv(hub_classifier, source, whole)) == 0
    expected = read_lines(whole)

    out = tmp_path / "p.jsonl"
    with monkeypatch.context() as patch:
        patch.setattr(kept_predictions, "iter_classify", stopped_after(2))
        with pytest.raises(KeyboardInterrupt) as stopped:
            predict.main(predict_argv(hub_classifier, source, out))
    kept_lines = tmp_path / ".p.jsonl.partial"
    assert str(stopped.value) == (
        f"10 of 23 predictions are kept in {kept_lines}; run the same command again to continue from them"
    )
    assert not out.exists()
    assert [r["index"] for r in read_lines(kept_lines)] == list(range(10))
    assert json.loads((tmp_path / ".p.jsonl.partial.json").read_text())["rows_written"] == 10
    with kept_lines.open("a") as f:  # a kill in the middle of the next chunk's write
        f.write('{"index": 10, "lab')

    capsys.readouterr()
    assert predict.main(predict_argv(hub_classifier, source, out)) == 0
    captured = capsys.readouterr()
    assert f"continuing after the 10 predictions an interrupted run kept ({kept_lines})" in captured.err
    assert json.loads(captured.out)["kept_from_earlier_run"] == 10
    got = read_lines(out)
    assert [r["index"] for r in got] == list(range(len(TEXTS)))
    assert [r["label"] for r in got] == [r["label"] for r in expected]
    for mine, theirs in zip(got, expected):
        assert mine["scores"] == pytest.approx(theirs["scores"], abs=2e-6)
    # nothing kept is left (the lock beside the output goes when the process ends: common.files.lock_folder)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".p.jsonl")) == [".p.jsonl.lock"]


def test_kept_predictions_of_another_input_are_not_continued(hub_classifier, tmp_path, monkeypatch, capsys):
    from packed_transformers.commands import kept_predictions, predict

    source = input_file(tmp_path / "in.jsonl", TEXTS)
    out = tmp_path / "p.jsonl"
    with monkeypatch.context() as patch:
        patch.setattr(kept_predictions, "iter_classify", stopped_after(1))
        with pytest.raises(KeyboardInterrupt):
            predict.main(predict_argv(hub_classifier, source, out))
    input_file(source, list(reversed(TEXTS)))  # the input changed: its kept rows belong to another job
    capsys.readouterr()
    assert predict.main(predict_argv(hub_classifier, source, out)) == 0
    assert "continuing after" not in capsys.readouterr().err
    assert [r["index"] for r in read_lines(out)] == list(range(len(TEXTS)))


def test_the_progress_bar_moves_chunk_by_chunk(hub_classifier, tmp_path, monkeypatch):
    """The bar was at 0 for the whole run and jumped to the end (issue 110 item 3): it is now
    advanced after every chunk."""
    import tqdm

    from packed_transformers.commands import predict

    advanced = []
    real = tqdm.tqdm.update
    monkeypatch.setattr(tqdm.tqdm, "update", lambda bar, n=1: advanced.append(n) or real(bar, n))
    source = input_file(tmp_path / "in.jsonl", TEXTS)
    argv = [a for a in predict_argv(hub_classifier, source, tmp_path / "p.jsonl") if a != "--quiet"]
    assert predict.main(argv) == 0
    assert advanced == [5, 5, 5, 5, 3]


def test_an_interrupt_ends_in_the_line_that_says_what_was_kept(capsys):
    from packed_transformers.common.cli import run_main

    def stopped():
        raise KeyboardInterrupt("3 of 9 predictions are kept in X")

    def stopped_early():
        raise KeyboardInterrupt

    assert run_main(stopped, "nothing was written") == 130
    assert run_main(stopped_early, "nothing was written") == 130
    assert capsys.readouterr().err.splitlines() == [
        "interrupted: 3 of 9 predictions are kept in X",
        "interrupted: nothing was written",
    ]
