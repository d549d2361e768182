"""verify's fingerprints, computed in place on each side's padded layout: equal for every
sequence on both sides, and changed by any single edit of a packed sequence."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from packed_transformers.data.synthetic import synthetic_rows
from packed_transformers.packing.format import Sequence, pack_sequences
from packed_transformers.packing.sources import Limits, validate_rows
from packed_transformers.packing.verify import pack_fingerprints, padded_fingerprints
from packed_transformers.packs.structure import first_malformed

S, P, K = 64, 6, 3


def _packed(seed: int, n: int):
    """(input rows, their fingerprints by source index, packs holding them in a shuffled
    order, K per pack at most, with the masked slots of each pack in their input order)."""
    rng = np.random.default_rng(seed)
    rows = synthetic_rows(rng.integers(4, 22, size=n), S, P, rng)
    lengths, predictions, problems = validate_rows(rows, Limits(S, P), "x", 0)
    assert not problems
    expected = padded_fingerprints(rows, lengths, predictions)
    order = rng.permutation(n)
    packs, current = [], []
    for i in order.tolist():
        sequence = Sequence(
            rows["input_ids"][i, : lengths[i]],
            rows["segment_ids"][i, : lengths[i]],
            rows["masked_lm_positions"][i, : predictions[i]],
            rows["masked_lm_ids"][i, : predictions[i]],
            int(rows["next_sentence_labels"][i]),
            i,
        )
        if len(current) == K or sum(len(x.input_ids) for x in current) + lengths[i] > S:
            packs.append(current)
            current = []
        current.append(sequence)
    packs.append(current)
    return rows, lengths, predictions, expected, pack_sequences(packs, S, K, P * K, vocab_size=30522)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40))
def test_both_layouts_give_every_sequence_the_same_fingerprint(seed, n):
    rows, lengths, predictions, expected, packs = _packed(seed, n)
    assert first_malformed(packs) is None
    found = pack_fingerprints(packs)
    assert sorted(found.source.tolist()) == list(range(n))
    np.testing.assert_array_equal(found.hashes, expected[found.source])
    np.testing.assert_array_equal(found.lengths, lengths[found.source])
    np.testing.assert_array_equal(found.predictions, predictions[found.source])
    np.testing.assert_array_equal(found.nsp, rows["next_sentence_labels"][found.source])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), field=st.sampled_from(["input_ids", "segment_ids", "masked_lm_ids",
                                                               "masked_lm_positions", "swap_masked"]))  # fmt: skip
def test_any_single_edit_of_a_packed_sequence_changes_both_hashes(seed, field):
    rows, _, _, expected, packs = _packed(seed, 30)
    rng = np.random.default_rng(seed)
    row = int(rng.integers(0, packs["input_ids"].shape[0]))
    real = np.flatnonzero(packs["sequence_ids"][row])
    masked = np.flatnonzero(packs["masked_lm_weights"][row])
    if field in ("input_ids", "segment_ids"):
        col = int(rng.choice(real))
        packs[field][row, col] = packs[field][row, col] ^ 1
    elif field == "masked_lm_ids":
        slot = int(rng.choice(masked))
        packs[field][row, slot] += 1
    elif field == "masked_lm_positions":  # another position of the same sequence
        slot = int(rng.choice(masked))
        owner = packs["sequence_ids"][row] == packs["masked_lm_weights"][row, slot]
        others = [c for c in np.flatnonzero(owner).tolist() if c != packs[field][row, slot]]
        packs[field][row, slot] = others[0]
    else:  # two masked slots of one sequence swapped: order is part of the content
        weights = packs["masked_lm_weights"][row]
        first = weights[masked[0]]
        same = masked[weights[masked] == first]
        if same.size < 2 or packs["masked_lm_ids"][row, same[0]] == packs["masked_lm_ids"][row, same[1]]:
            return
        for name in ("masked_lm_positions", "masked_lm_ids"):
            packs[name][row, [same[0], same[1]]] = packs[name][row, [same[1], same[0]]]
    assert first_malformed(packs) is None
    found = pack_fingerprints(packs)
    differs = (found.hashes != expected[found.source]).all(axis=1)
    assert differs.sum() == 1 and found.where[differs][0] == row


def test_masked_slots_out_of_the_order_pack_writes_are_named():
    from packed_transformers.packing.verify import masked_slots_out_of_order

    rows, _, _, _, packs = _packed(7, 30)
    assert masked_slots_out_of_order(packs) is None
    for bad in ([2, 2, 1, 0], [1, 0, 2, 0], [0, 1, 0, 0]):
        edited = dict(packs, masked_lm_weights=packs["masked_lm_weights"].copy())
        edited["masked_lm_weights"][4] = 0
        edited["masked_lm_weights"][4, : len(bad)] = bad
        assert masked_slots_out_of_order(edited) == 4
