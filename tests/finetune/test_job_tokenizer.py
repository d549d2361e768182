"""Fine-tuning gets one LoadedModel from the door, carrying the tokenizer its rows were made
with (issue 80): the tokenizer is built once, before the model (the head's size follows the
labels the data holds), handed to the door, and what the job trains on is that tokenizer's
output, on every task's path (WordPiece over a vocab.txt, a folder's own tokenizer.json, a
decoder's transformers tokenizer)."""

from __future__ import annotations

import json

import numpy as np

from packed_transformers.finetune.config import load_finetune_config
from packed_transformers.finetune.specs import SPECS

from ..decoder_helpers import config_for
from ..finetune_helpers import write_config


def first_text(path) -> tuple[str, str | None]:
    record = json.loads(path.read_text().splitlines()[0])
    return record["text"], record.get("text_pair")


def test_a_wordpiece_job_carries_the_vocabulary_it_tokenized_with(tmp_path, checkpoint):
    config = load_finetune_config(write_config(tmp_path, checkpoint))
    job = SPECS["classification"].read_input(config, None).build()
    opened = job.opened
    positions = json.loads((checkpoint / "config.json").read_text())["max_position_embeddings"]
    assert job.model is opened.model and opened.max_length == positions
    assert opened.vocab is not None and opened.token_types and opened.transformers_tokenizer is None
    # the carried tokenizer gives the rows the job trains on
    text, pair = first_text(tmp_path / "train.jsonl")
    ids = opened.tokenizer.encode(text, pair).ids
    assert np.array_equal(job.train.token_ids[0], ids)


def test_a_folder_with_its_own_tokenizer_hands_it_to_the_model(tmp_path, hub_classifier):
    config = load_finetune_config(write_config(tmp_path, hub_classifier))
    job = SPECS["classification"].read_input(config, None).build()
    opened = job.opened
    assert opened.vocab is None and opened.transformers_tokenizer is not None
    text, pair = first_text(tmp_path / "train.jsonl")
    expected = opened.transformers_tokenizer(text, pair)["input_ids"]
    assert list(job.train.token_ids[0]) == expected == opened.tokenizer.encode(text, pair).ids


def test_sft_carries_its_transformers_tokenizer(tmp_path, start_folder):
    job = SPECS["causal_lm"].read_input(config_for(tmp_path, start_folder), None).build()
    opened = job.opened
    hf = opened.transformers_tokenizer
    assert hf is not None and hf.eos_token_id is not None
    assert opened.tokenizer.to_str() == hf.backend_tokenizer.to_str()
    assert opened.token_types is ("token_type_ids" in hf.model_input_names)
    # every trained row ends with the carried tokenizer's EOS
    assert all(int(row[-1]) == hf.eos_token_id for row in job.train.token_ids)
