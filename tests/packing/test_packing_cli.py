"""`python -m packed_transformers.packing report`: the JSON contract, the table, and bad inputs (exit 2, no traceback)."""

import json
import subprocess
import sys

import pytest

from ..conftest import HISTOGRAMS, REPO

KEYS = [
    "algorithm",
    "max_sequence_length",
    "max_sequences_per_pack",
    "sequences",
    "packs",
    "real_tokens",
    "padding_tokens",
    "efficiency",
    "packing_factor",
    "theoretical_speedup",
    "strategies_used",
    "max_depth",
    "seconds",
]


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "packed_transformers.packing", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


SQUAD_LPFHP = ("report", "--histogram", str(HISTOGRAMS / "squad_384.json"), "--algorithm", "lpfhp",
               "--max-sequences-per-pack")  # fmt: skip


def test_report_json_contract():
    r = run(
        *SQUAD_LPFHP,
        "3",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)  # exactly one JSON object, nothing else on stdout
    assert list(data) == KEYS
    assert data["algorithm"] == "lpfhp" and data["max_sequences_per_pack"] == 3
    assert data["sequences"] == 88641 and data["max_sequence_length"] == 384
    assert data["padding_tokens"] == data["packs"] * 384 - data["real_tokens"]
    assert 0 < data["efficiency"] <= 1 and data["max_depth"] <= 3
    assert data["packing_factor"] == pytest.approx(data["sequences"] / data["packs"])


@pytest.mark.slow
def test_report_max_depth_and_plot(tmp_path):
    png = tmp_path / "p.png"
    r = run(
        "report",
        "--histogram",
        str(HISTOGRAMS / "squad_384.json"),
        "--algorithm",
        "lp",
        "--max-sequences-per-pack",
        "max",
        "--json",
        "--plot",
        str(png),
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["max_sequences_per_pack"] == "max"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_table(tmp_path):
    small = tmp_path / "h.json"
    small.write_text(json.dumps({"max_sequence_length": 16, "counts": [3] * 16}))
    r = run("report", "--histogram", str(small))
    assert r.returncode == 0, r.stderr
    for name in ("none", "spfhp", "lpfhp", "nnlshp", "lp", "bfd", "greedy", "K=max"):
        assert name in r.stdout


@pytest.mark.parametrize(
    "content,message",
    [
        ({"max_sequence_length": 3, "counts": [1, -1, 2]}, "counts[1] must be >= 0"),
        ({"max_sequence_length": 3, "counts": [1, 1.5, 2]}, "counts[1] must be a finite integer"),
        ('{"max_sequence_length": 3, "counts": [1, NaN, 2]}', "counts[1] must be a finite integer"),
        ('{"max_sequence_length": 3, "counts": [1, Infinity, 2]}', "counts[1] must be a finite integer"),
        ({"max_sequence_length": 3, "counts": [1, "2", 2]}, "counts[1] must be a number"),
        ({"max_sequence_length": 3, "counts": [1, 2]}, "counts has 2 entries, expected"),
        ({"max_sequence_length": 0, "counts": []}, "max_sequence_length must be an integer >= 1"),
        ({"max_sequence_length": 3, "counts": [0, 0, 0]}, "histogram is empty"),
        ({"counts": [1]}, "missing key 'max_sequence_length'"),
        ("{not json", "malformed JSON"),
        ([1, 2, 3], "expected a JSON object"),
    ],
)
def test_bad_histogram_files(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    r = run("report", "--histogram", str(path), "--algorithm", "lpfhp", "--json")
    assert r.returncode == 2
    assert message in r.stderr and str(path) in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("k", ["0", "-3", "two"])
def test_bad_depth(k):
    r = run(
        *SQUAD_LPFHP,
        k,
    )
    assert r.returncode == 2 and "max sequences per pack" in r.stderr and "Traceback" not in r.stderr


def test_missing_file_and_bad_algorithm(tmp_path):
    r = run("report", "--histogram", str(tmp_path / "nope.json"))
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
    r = run("report", "--histogram", str(HISTOGRAMS / "squad_384.json"), "--algorithm", "magic")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_nnlshp_depth_limit_is_a_user_error():
    r = run(
        "report",
        "--histogram",
        str(HISTOGRAMS / "squad_384.json"),
        "--algorithm",
        "nnlshp",
        "--max-sequences-per-pack",
        "4",
    )
    assert r.returncode == 2 and "at most 3" in r.stderr
