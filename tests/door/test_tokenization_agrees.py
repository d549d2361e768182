"""A folder is tokenized as transformers' AutoTokenizer tokenizes it (cased vocab.txt folders,
combining marks), so predictions equal transformers'."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ..folder_helpers import input_file

# ----- 2. (high) tokens exactly as transformers makes them -------------------------------------------
COMBINING = ["e\u0301 a\u0308 o\u0302 cafe\u0301", "Zoe\u0308 and Ame\u0301lie", "plain text"]


@pytest.fixture(scope="module")
def qwen2_classifier(tmp_path_factory):
    """A tiny Qwen2 classification folder whose tokenizer.json has no normalizer, and whose
    tokenizer_config.json names Qwen2Tokenizer: transformers' class adds NFC and Qwen2's
    split pattern whatever the file says."""
    import transformers

    from ..decoder_helpers import decoder_tokenizer, tiny_config

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

    from packed_transformers.door.folder import load_finetuned
    from packed_transformers.inference.embedding import load_encoder

    reference = AutoTokenizer.from_pretrained(qwen2_classifier)
    expected = [reference(text)["input_ids"] for text in COMBINING]
    from tokenizers import Tokenizer

    alone = Tokenizer.from_file(str(qwen2_classifier / "tokenizer.json"))
    assert [alone.encode(t).ids for t in COMBINING] != expected  # the file alone differs (the defect)
    assert [load_finetuned(qwen2_classifier).tokenizer.encode(t).ids for t in COMBINING] == expected
    ids, _ = load_encoder(qwen2_classifier, pooling="lasttoken").tokenize_texts(
        COMBINING, ["t"] * len(COMBINING)
    )
    assert [list(map(int, i)) for i in ids] == expected


def test_predict_scores_equal_transformers_on_text_with_combining_marks(qwen2_classifier, tmp_path):
    import transformers
    from transformers import AutoTokenizer

    from packed_transformers.commands import predict

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
