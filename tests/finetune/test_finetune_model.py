"""Packed sequence classification against Hugging Face's unpacked BertForSequenceClassification."""

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from packed_transformers.data.classification_data import TokenizedExamples
from packed_transformers.inference.predictions import predict_logits
from packed_transformers.model.bert_heads import PackedBertForSequenceClassification, classification_metrics
from packed_transformers.packs.batching import BATCHING_MODES, Batcher, BatchingSpec
from packed_transformers.packs.rows import pack_rows, unpack_outputs
from packed_transformers.packs.tokenized import pack_examples

VOCAB = 97
CLASSES = 4


def tiny_config(problem_type):
    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=CLASSES,
        problem_type=problem_type,
    )


@pytest.fixture(scope="module", params=["single_label_classification", "multi_label_classification"])
def models(request, tmp_path_factory):
    """(HF reference, ours loaded from the reference's saved folder), both in eval mode."""
    torch.manual_seed(0)
    reference = BertForSequenceClassification(tiny_config(request.param)).eval()
    folder = tmp_path_factory.mktemp("hf")
    reference.save_pretrained(folder)
    ours = PackedBertForSequenceClassification.from_pretrained(folder).eval()
    assert ours.loading_report.get("missing_keys") is None
    return reference, ours


def random_examples(rng, n, max_len=30, multi_label=False):
    tokens, segments = [], []
    for _ in range(n):
        length = int(rng.integers(3, max_len + 1))
        ids = rng.integers(5, VOCAB, size=length).astype(np.int32)
        ids[0] = 2
        split = int(rng.integers(1, length))
        tokens.append(ids)
        segments.append((np.arange(length) >= split).astype(np.int32))
    if multi_label:
        labels = rng.integers(0, 2, size=(n, CLASSES)).astype(np.uint8)
    else:
        labels = rng.integers(0, CLASSES, size=n)
    return TokenizedExamples(tokens, segments, labels, truncated=0)


def reference_logits(reference, data):
    """Each example alone through HF: no padding, no mask, the unpacked ground truth."""
    with torch.no_grad():
        return np.concatenate(
            [
                reference(
                    input_ids=torch.from_numpy(t.astype(np.int64))[None],
                    token_type_ids=torch.from_numpy(s.astype(np.int64))[None],
                ).logits.numpy()
                for t, s in zip(data.token_ids, data.segment_ids)
            ]
        )


def test_packed_logits_equal_unpacked_per_example(models):
    reference, ours = models
    rng = np.random.default_rng(1)
    data = random_examples(rng, 40)
    expected = reference_logits(reference, data)
    for k in (2, 3, 8):
        table = pack_examples(data.lengths, 64, k, "lpfhp", seed=k)
        assert table.shape[0] < len(data)  # really packed
        rows = pack_rows(data.token_ids, table, 64, data.segment_ids)
        with torch.no_grad():
            logits = ours(**{n: torch.from_numpy(v) for n, v in rows.items()})["logits"].numpy()
        got = unpack_outputs(logits, rows["example_index"], len(data))
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", BATCHING_MODES)
def test_every_batching_mode_gives_the_reference_logits_in_input_order(models, mode):
    reference, ours = models
    data = random_examples(np.random.default_rng(2), 37)
    spec = BatchingSpec(mode, batch_size=8, max_sequence_length=64, max_per_pack=4, algorithm="spfhp")
    got, timing = predict_logits(ours, data, Batcher(data.lengths, spec, seed=3))
    np.testing.assert_allclose(got, reference_logits(reference, data), atol=1e-5, rtol=0)
    assert 0 <= timing["padding_fraction"] < 1


def test_loss_matches_hf_loss_over_the_same_examples(models):
    reference, ours = models
    multi = ours.multi_label
    data = random_examples(np.random.default_rng(4), 12, multi_label=multi)
    table = pack_examples(data.lengths, 64, 3, "lpfhp", seed=0)
    rows = pack_rows(data.token_ids, table, 64, data.segment_ids)
    labels = data.labels[np.maximum(table, 0)]
    batch = {n: torch.from_numpy(v) for n, v in rows.items()}
    batch["labels"] = torch.from_numpy(labels.astype(np.float32 if multi else np.int64))
    with torch.no_grad():
        out = ours(**batch)
        # HF pads a batch and masks padding with its own 2-D attention mask.
        longest = max(data.lengths)
        ids = torch.zeros(len(data), longest, dtype=torch.long)
        seg, mask = torch.zeros_like(ids), torch.zeros_like(ids)
        for i, (t, s) in enumerate(zip(data.token_ids, data.segment_ids)):
            ids[i, : len(t)], seg[i, : len(t)], mask[i, : len(t)] = (
                torch.from_numpy(t),
                torch.from_numpy(s),
                1,
            )
        hf_labels = torch.from_numpy(data.labels.astype(np.float32 if multi else np.int64))
        hf = reference(input_ids=ids, token_type_ids=seg, attention_mask=mask, labels=hf_labels)
    assert int(out["count"]) == len(data)
    assert float(out["loss"]) == pytest.approx(float(hf.loss), abs=1e-5)


def test_saved_folder_loads_in_transformers_with_the_same_logits(models, tmp_path):
    reference, ours = models
    ours.save_pretrained(tmp_path / "saved")
    again = BertForSequenceClassification.from_pretrained(tmp_path / "saved").eval()
    ids = torch.randint(5, VOCAB, (3, 17))
    with torch.no_grad():
        np.testing.assert_allclose(again(ids).logits.numpy(), reference(ids).logits.numpy(), atol=1e-6)


def test_multi_label_loss_ignores_absent_slots():
    """Garbage (inf logits, labels of 1) in empty slots changes neither loss nor gradients."""
    torch.manual_seed(0)
    logits = torch.randn(3, 4, CLASSES)
    labels = torch.randint(0, 2, (3, 4, CLASSES)).float()
    present = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    garbage_logits = torch.where(present[..., None], logits, torch.tensor(float("inf")))
    garbage_labels = torch.where(present[..., None], labels, torch.tensor(1.0))
    leaf = garbage_logits.clone().requires_grad_()
    out = classification_metrics(leaf, garbage_labels, present, multi_label=True)
    out["loss"].backward()
    expected = torch.nn.functional.binary_cross_entropy_with_logits(logits[present], labels[present])
    assert torch.isfinite(out["loss"])
    assert float(out["loss"].detach()) == pytest.approx(float(expected), abs=1e-6)
    assert int(out["count"]) == 6 and int(out["correct_count"]) == 6 * CLASSES
    assert torch.all(leaf.grad[~present] == 0)
    expected_correct = ((logits[present] > 0) == (labels[present] > 0.5)).sum()
    assert int(out["correct"]) == int(expected_correct)


def test_single_label_ignores_absent_slot_labels():
    logits = torch.randn(2, 3, CLASSES)
    present = torch.tensor([[1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    labels = torch.tensor([[1, 99, -5], [0, 3, 12345]])  # out-of-range values in absent slots
    out = classification_metrics(logits, labels, present, multi_label=False)
    expected = torch.nn.functional.cross_entropy(logits[present], labels[present])
    assert float(out["loss"]) == pytest.approx(float(expected), abs=1e-6)


@pytest.mark.parametrize("backend", ["dense", "sdpa", "varlen"])
def test_packed_gradients_equal_transformers_per_example(backend, tmp_path):
    """Forward and backward against transformers: the packed classifier's loss over a batch
    of packs has the gradient of HF's mean loss over the same examples, each run alone
    (fp32, every parameter). The last layer computes the [CLS] rows only; this is where a
    wrong row, mask or residual would show."""
    torch.manual_seed(0)
    reference = BertForSequenceClassification(tiny_config("single_label_classification")).eval()
    reference.save_pretrained(tmp_path)
    ours = PackedBertForSequenceClassification.from_pretrained(tmp_path, attention_backend=backend).eval()
    data = random_examples(np.random.default_rng(5), 11)
    table = pack_examples(data.lengths, 64, 3, "lpfhp", seed=1)
    rows = pack_rows(data.token_ids, table, 64, data.segment_ids)
    batch = {n: torch.from_numpy(v) for n, v in rows.items()}
    batch["labels"] = torch.from_numpy(data.labels[np.maximum(table, 0)].astype(np.int64))
    ours(**batch)["loss"].backward()
    losses = []
    for t, s, y in zip(data.token_ids, data.segment_ids, data.labels):
        out = reference(
            input_ids=torch.from_numpy(t.astype(np.int64))[None],
            token_type_ids=torch.from_numpy(s.astype(np.int64))[None],
            labels=torch.tensor([int(y)]),
        )
        losses.append(out.loss)
    torch.stack(losses).mean().backward()
    theirs = dict(reference.named_parameters())
    for name, parameter in ours.named_parameters():
        expected = theirs[name].grad
        if expected is None:  # HF's position_ids buffer etc. have no gradient
            continue
        scale = float(expected.abs().max()) or 1.0
        assert float((parameter.grad - expected).abs().max()) <= 1e-5 * max(scale, 1.0), name
