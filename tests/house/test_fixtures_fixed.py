"""The tests' fixtures are the same bytes in every process and on every run (issue 105).

Tokenizers learned at test time gave each process its own vocabulary (tokenizers issue 1794),
so two xdist workers of one run, and two runs, tested different inputs. Two fresh
interpreters here build every shared tokenizer and tiny model folder and digest each file;
the digests must agree, file for file. A builder that learned, drew without a seed or wrote a
time into a file fails this test (tried: against the trained tokenizers of 6002aac, the
WordPiece and Unigram families' tokenizer.json differed between the two processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import REPO
from ..fixture_tokenizers import FOLDER

# Run in a fresh interpreter: build every fixture folder under argv[1], print {name: digests}.
BUILD_ALL = r"""
import json, sys
from pathlib import Path
from tests.conftest import folder_digest, sft_start_folder, small_minilm_folder, tiny_bert_checkpoint
from tests.family_helpers import FAMILIES, save_family_folder
from tests.folder_helpers import tiny_hub_classifier
from tests.fixture_tokenizers import bert_vocabulary
from transformers import BertTokenizerFast

root = Path(sys.argv[1])
built = {f"family-{name}": save_family_folder(root / name, name, "classification") for name in FAMILIES}
built["checkpoint"] = tiny_bert_checkpoint(root / "checkpoint")
built["sft-start"] = sft_start_folder(root / "sft-start")
built["small-minilm"] = small_minilm_folder(root / "small-minilm")
built["hub-classifier"] = tiny_hub_classifier(root / "hub")
cased = BertTokenizerFast(vocab=bert_vocabulary("wordpiece-cased-1200.txt"), do_lower_case=False)
cased.save_pretrained(root / "cased")
built["cased-tokenizer"] = root / "cased"
print(json.dumps({name: folder_digest(folder) for name, folder in built.items()}))
"""


def build_in_fresh_process(folder) -> dict:
    done = subprocess.run([sys.executable, "-c", BUILD_ALL, str(folder)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_two_fresh_processes_build_byte_identical_fixtures(tmp_path):
    first, second = build_in_fresh_process(tmp_path / "a"), build_in_fresh_process(tmp_path / "b")
    assert sorted(first) == sorted(second)
    for name in first:
        files = first[name]
        assert {"tokenizer.json", "vocab.txt"} & set(files), (name, sorted(files))
        assert any(f.endswith(".safetensors") for f in files) or name == "cased-tokenizer", (
            name,
            sorted(files),
        )
        differ = sorted(f for f in set(files) | set(second[name]) if files.get(f) != second[name].get(f))
        assert not differ, f"{name}: these files differ between two fresh processes: {differ}"


def test_the_stored_tokenizers_are_read_not_learned():
    """Every stored tokenizer is a valid tokenizer.json or vocabulary; nothing in tests/ trains one
    but the script that wrote them (a house rule: learned fixtures differ per process)."""
    from ..fixture_tokenizers import bert_vocabulary, stored_tokenizer

    for path in sorted(FOLDER.iterdir()):
        if path.suffix == ".json":
            assert stored_tokenizer(path.name).get_vocab_size() > 250, path
        else:
            vocab = bert_vocabulary(path.name)
            assert list(vocab)[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], path
    learners = sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("*.py")
        if "train_from_iterator" in p.read_text() and p.parent.name != "fixtures" and p != Path(__file__)
    )
    assert learners == [], f"these test files learn a tokenizer at test time: {learners}"
