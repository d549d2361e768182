"""`packed mine-negatives` (issue 109 item 1): hard negatives mined on packs equal
sentence-transformers' own `mine_hard_negatives` ("top" sampling, n-tuple output) as its users
call it, line for line; a query's positives (every line of it) are never its negatives; nothing
is dropped; mistakes are one line."""

from __future__ import annotations

import json

import pytest


def bbc_pairs(count: int) -> list[dict]:
    from packed_transformers.data.assets import corpus_glob
    from packed_transformers.data.embedding_texts import bbc_articles, pairs_of

    found = pairs_of(bbc_articles(corpus_glob()))[:count]
    return [{"query": p["anchor"], "positive": p["positive"][:400]} for p in found]


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("margin", [None, 0.05])
def test_mined_negatives_equal_sentence_transformers_mine_hard_negatives(tmp_path, capsys, margin):
    """On MiniLM itself (the asset): a margin below a positive's score means something only
    where positives score high, as a trained embedder's do."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    from packed_transformers.commands import mine_negatives
    from packed_transformers.data.assets import model_dir

    small_minilm = model_dir()

    pairs = bbc_pairs(40)
    pairs.append({"query": pairs[0]["query"], "positive": pairs[1]["positive"]})  # a query with two positives
    source = write_lines(tmp_path / "pairs.jsonl", pairs)
    out = tmp_path / "groups.jsonl"
    argv = ["--model", str(small_minilm), "--input", str(source), "--output", str(out), "--negatives", "3",
            "--range-min", "1"] + ([] if margin is None else ["--relative-margin", str(margin)])  # fmt: skip
    assert mine_negatives.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["lines"] == 41 and summary["queries"] == 40 and summary["lines_with_fewer_negatives"] == 0
    mined = read_lines(out)
    assert [(r["query"], r["positive"]) for r in mined] == [(p["query"], p["positive"]) for p in pairs]

    theirs = mine_hard_negatives(
        Dataset.from_list(pairs), SentenceTransformer(str(small_minilm), device="cpu"), num_negatives=3, range_min=1,
        relative_margin=margin, sampling_strategy="top", output_format="n-tuple", verbose=False,
    )  # fmt: skip
    by_pair = {(r["query"], r["positive"]): [r[f"negative_{i}"] for i in (1, 2, 3)] for r in theirs}
    assert len(by_pair) == len(pairs)  # none dropped on their side either: the comparison is whole
    for record in mined:
        assert record["negative"] == by_pair[record["query"], record["positive"]], record["query"]
    # both positives of the query with two lines are among neither line's negatives
    for record in mined[:1] + mined[-1:]:
        assert not {pairs[0]["positive"], pairs[1]["positive"]} & set(record["negative"])


def test_a_line_with_too_few_candidates_is_kept_and_counted(small_minilm, tmp_path, capsys):
    from packed_transformers.commands import mine_negatives

    pairs = bbc_pairs(4)
    source = write_lines(tmp_path / "pairs.jsonl", pairs)
    out = tmp_path / "groups.jsonl"
    assert mine_negatives.main(["--model", str(small_minilm), "--input", str(source), "--output", str(out),
                                "--negatives", "5", "--range-max", "20"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    assert json.loads(captured.out)["lines_with_fewer_negatives"] == 4
    assert "note: 4 of 4 lines have fewer than 5 negatives" in captured.err
    assert [len(r["negative"]) for r in read_lines(out)] == [3, 3, 3, 3]  # every other positive


def test_mistakes_are_one_line_and_write_nothing(small_minilm, tmp_path, capsys):
    from packed_transformers.commands import mine_negatives

    source = write_lines(
        tmp_path / "pairs.jsonl", [{"query": "a question", "positive": "an answer"}, {"query": "q"}]
    )
    out = tmp_path / "groups.jsonl"
    base = ["--model", str(small_minilm), "--input", str(source), "--output", str(out)]
    assert mine_negatives.main(base) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {source}:2: field 'positive' is missing or empty (a positive text each line)"
    )
    assert mine_negatives.main([*base, "--range-max", "3", "--negatives", "5"]) == 2
    assert "fewer than --negatives 5" in capsys.readouterr().err
    assert mine_negatives.main([*base[:-1], str(source)]) == 2  # the output over its input
    capsys.readouterr()
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["pairs.jsonl"]
