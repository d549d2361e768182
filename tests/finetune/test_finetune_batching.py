"""The four batching modes and the tokenized-dataset packer: every example exactly once,
outputs back in input order."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packed_transformers.components.batches import collate
from packed_transformers.data.classification_data import TokenizedExamples
from packed_transformers.inference.predictions import predict_logits
from packed_transformers.packs.batching import BATCHING_MODES, Batcher, BatchingSpec
from packed_transformers.packs.errors import PackingInputError
from packed_transformers.packs.rows import pack_rows, pad_table
from packed_transformers.packs.tokenized import pack_examples

S = 48

lengths_strategy = st.lists(st.integers(1, S), min_size=1, max_size=120).map(np.array)


@settings(max_examples=60, deadline=None)
@given(
    lengths=lengths_strategy,
    mode=st.sampled_from(BATCHING_MODES),
    batch_size=st.integers(1, 40),
    k=st.integers(1, 8),
    pad_last=st.booleans(),
    epoch=st.integers(0, 3),
    seed=st.integers(0, 2**31),
)
def test_every_mode_sees_every_example_exactly_once_per_epoch(
    lengths, mode, batch_size, k, pad_last, epoch, seed
):
    spec = BatchingSpec(mode, batch_size, S, k, "spfhp", pad_last)
    batcher = Batcher(lengths, spec, seed)
    batches = batcher.epoch(epoch)
    assert len(batches) == batcher.batches_per_epoch
    slots = np.concatenate([b.ravel() for b in batches])
    assert np.array_equal(np.sort(slots[slots >= 0]), np.arange(len(lengths)))
    for table in batches:
        width = batcher.width(table)
        present = table[table >= 0]
        assert (lengths[present].reshape(-1) <= width).all()
        if mode == "packed":
            assert (lengths[np.maximum(table, 0)] * (table >= 0)).sum(axis=1).max() <= S
        else:
            assert table.shape[1] == 1
        if pad_last:
            assert len(table) == batcher.rows_per_batch  # static shape: empty rows fill it
    if mode in ("dynamic", "uniform"):
        assert all(batcher.width(t) == lengths[t[t >= 0]].max() for t in batches)
    if mode == "uniform":
        # Buckets are contiguous runs of the sorted lengths.
        spans = sorted((lengths[t[t >= 0]].min(), lengths[t[t >= 0]].max()) for t in batches)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_epochs_differ_but_repeat_for_a_seed():
    lengths = np.random.default_rng(0).integers(1, S, size=200)
    for mode in BATCHING_MODES:
        batcher = Batcher(lengths, BatchingSpec(mode, 16, S, 4), seed=7)
        first = np.concatenate(batcher.epoch(0)).ravel()
        assert np.array_equal(first, np.concatenate(Batcher(lengths, batcher.spec, 7).epoch(0)).ravel())
        assert not np.array_equal(first, np.concatenate(batcher.epoch(1)).ravel())


def test_packed_batches_hold_about_batch_size_examples():
    lengths = np.random.default_rng(0).integers(5, 40, size=500)
    batcher = Batcher(lengths, BatchingSpec("packed", 32, 128, 8), seed=0)
    assert batcher.packing_factor > 3
    assert batcher.rows_per_batch == round(32 / batcher.packing_factor)


def test_padding_fraction_counts_the_row_width():
    lengths = np.array([4, 8, 8, 16])
    padded = Batcher(lengths, BatchingSpec("padded", 2, 16), 0)
    assert padded.padding_fraction(padded.epoch(0, shuffle=False)) == pytest.approx(1 - 36 / 64)
    dynamic = Batcher(lengths, BatchingSpec("dynamic", 2, 16), 0)
    assert dynamic.padding_fraction(dynamic.epoch(0, shuffle=False)) == pytest.approx(1 - 36 / (16 + 32))


class EchoModel(torch.nn.Module):
    """'Logits' = the token after each example's [CLS], which encodes the example's index."""

    def forward(self, input_ids, cls_positions, **rest):
        after_cls = torch.gather(input_ids, 1, (cls_positions + 1).clamp(max=input_ids.shape[1] - 1))
        return {"logits": after_cls[..., None].float()}


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(2, S), min_size=1, max_size=80),
    mode=st.sampled_from(BATCHING_MODES),
    k=st.integers(1, 8),
    batch_size=st.integers(1, 20),
    algorithm=st.sampled_from(["spfhp", "lpfhp", "lp", "nnlshp"]),
)
def test_inference_output_order_equals_input_order(lengths, mode, k, batch_size, algorithm):
    if algorithm == "nnlshp":
        k = min(k, 3)
    tokens = [np.array([2, i, *([7] * (n - 2))], dtype=np.int32) for i, n in enumerate(lengths)]
    data = TokenizedExamples(tokens, [np.zeros_like(t) for t in tokens], np.zeros(len(tokens)), 0)
    spec = BatchingSpec(mode, batch_size, S, k, algorithm, pad_last_batch=True)
    logits, _ = predict_logits(EchoModel(), data, Batcher(data.lengths, spec, seed=1))
    assert np.array_equal(logits[:, 0], np.arange(len(lengths)))


def test_pack_rows_layout():
    tokens = [np.array([2, 11, 3]), np.array([2, 12, 13, 3]), np.array([2, 3])]
    segments = [np.array([0, 0, 0]), np.array([0, 0, 1, 1]), np.array([0, 0])]
    rows = pack_rows(tokens, np.array([[1, 0], [2, -1]]), 8, segments)
    assert rows["input_ids"][0].tolist() == [2, 12, 13, 3, 2, 11, 3, 0]
    assert rows["segment_ids"][0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert rows["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert rows["sequence_ids"][0].tolist() == [1, 1, 1, 1, 2, 2, 2, 0]
    assert rows["cls_positions"].tolist() == [[0, 4], [0, 0]]
    assert rows["example_index"].tolist() == [[1, 0], [2, -1]]


def test_collate_zeroes_labels_of_empty_slots():
    tokens = [np.array([2, 3])] * 3
    data = TokenizedExamples(tokens, [np.zeros(2, np.int32)] * 3, np.array([4, 1, 2]), 0)
    batch = collate(data, pad_table(np.array([[0, 2], [1, -1]]), 3), 8)
    assert batch["labels"].tolist() == [[4, 2], [1, 0], [0, 0]]
    assert batch["example_index"].tolist() == [[0, 2], [1, -1], [-1, -1]]


def test_pack_examples_refuses_lengths_out_of_range():
    with pytest.raises(PackingInputError, match="example 1 has 60 tokens; expected 1..48"):
        pack_examples(np.array([3, 60, 5]), S, 3, "spfhp", 0)


def test_the_default_k_follows_the_lengths_and_an_explicit_k_wins():
    """Issue 61: short texts in 128-token rows left 42.6% padding at the old default K = 6.
    K chosen from the histogram (packs.tokenized.fitting_depth) leaves <= 10%; long
    examples get a shallow K; an explicit K is a limit that holds."""
    rng = np.random.default_rng(0)
    short = rng.integers(6, 30, 2000)
    chosen = Batcher(short, BatchingSpec("packed", 32, 128), seed=0)
    assert chosen.padding_fraction(chosen.epoch(0)) <= 0.10 and chosen.table.shape[1] > 6
    limited = Batcher(short, BatchingSpec("packed", 32, 128, max_per_pack=6), seed=0)
    assert limited.table.shape[1] <= 6 and limited.padding_fraction(limited.epoch(0)) > 0.15
    long = Batcher(rng.integers(200, 400, 500), BatchingSpec("packed", 32, 512), seed=0)
    assert long.table.shape[1] <= 3


def test_a_run_of_documents_cut_at_the_width_is_told_of_packs_twice_as_wide():
    """Documents truncated at max_sequence_length fill one pack each at that width (one of
    400 tokens cannot pair with another); packs of twice the width pair them. The note
    names the wider width and the padding it would leave, which is what a run at that width
    gets; short texts, or a pack_length the user set, get no such note."""
    from packed_transformers.packs.tokenized import wider_packs

    rng = np.random.default_rng(0)
    documents = np.minimum(rng.integers(250, 900, 600), 512)  # a third cut at 512
    default = Batcher(documents, BatchingSpec("packed", 32, 512, algorithm="lpfhp"), seed=0)
    padding = default.padding_fraction([default.table])
    assert padding > 0.05
    hint = wider_packs(documents, 512, padding)
    assert hint is not None and hint.pack_length == 1024 and hint.padding <= padding / 2
    wider = Batcher(documents, BatchingSpec("packed", 32, 512, algorithm="lpfhp", pack_length=1024), seed=0)
    assert wider.padding_fraction([wider.table]) == pytest.approx(hint.padding, abs=0.005)
    assert f"packs of 1024 tokens would leave {hint.padding:.1%}" in default.packing_note(None)
    assert "would leave" not in wider.packing_note(None)  # a width the user set is kept as is
    short = Batcher(rng.integers(8, 60, 600), BatchingSpec("packed", 32, 128), seed=0)
    assert wider_packs(short.lengths, 128, short.padding_fraction([short.table])) is None
    assert "would leave" not in short.packing_note(None)
