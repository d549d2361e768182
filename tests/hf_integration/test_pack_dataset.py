"""pack_dataset on datasets a user brings: refusals naming column and row, extra columns and
every label kind packed once, answer labels mapped back exactly."""

from __future__ import annotations

import numpy as np
import pytest
from datasets import Dataset, IterableDataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packed_transformers.data import assets
from packed_transformers.data.qa_data import QaExamples
from packed_transformers.data.qa_windows import fast_tokenizer, make_windows
from packed_transformers.data.tokenizer import load_tokenizer
from packed_transformers.hf_integration.trainer import PackedDatasetError, pack_dataset

IDS = [[101, 5, 102], [101, 7, 8, 102]]


SINGLE, MULTI, TOKENS, QA = (
    "single_label_classification", "multi_label_classification", "token_classification", "question_answering",
)  # fmt: skip


# (columns, task, pack_dataset options, the refusal's words)
REFUSED = [
    ({"input_ids": [], "label": []}, SINGLE, {}, "the dataset has no rows"),
    ({"input_ids": IDS}, SINGLE, {}, "no column 'label'"),
    ({"label": [0, 1]}, SINGLE, {}, "no column 'input_ids'"),
    ({"input_ids": [IDS[0], None], "label": [0, 1]}, SINGLE, {}, "column 'input_ids', row 1: expected a list of integers, got None"),
    ({"input_ids": [[101, None, 102], IDS[1]], "label": [0, 1]}, SINGLE, {}, "column 'input_ids', row 0: expected a list of integers"),
    ({"input_ids": [[101.5, 5.0, 102.0]], "label": [0]}, SINGLE, {}, "column 'input_ids', row 0: expected a list of integers"),
    ({"input_ids": [[101, -5, 102]], "label": [0]}, SINGLE, {}, "column 'input_ids', row 0: token id -5 is negative"),
    ({"input_ids": [[101] + [5] * 20 + [102]], "label": [0]}, SINGLE, {}, "row 0: 22 tokens, more than max_sequence_length 16"),
    ({"input_ids": IDS, "label": [0, None]}, SINGLE, {}, "column 'label', row 1: expected an integer, got None"),
    ({"input_ids": IDS, "label": [0, -100]}, SINGLE, {}, "column 'label', row 1: label -100 is negative"),
    ({"input_ids": IDS, "label": [0, 5]}, SINGLE, {"num_labels": 2}, "column 'label', row 1: label 5 is outside 0..1"),
    ({"input_ids": IDS, "label": ["a", "b"]}, SINGLE, {}, "column 'label', row 0: expected an integer, got 'a'"),
    ({"input_ids": IDS, "label": [True, False]}, SINGLE, {}, "column 'label', row 0: expected an integer, got True"),
    ({"input_ids": IDS, "label": [[0, 1], [1, 0, 1]]}, MULTI, {}, "column 'label', row 1: expected a list of 2 numbers"),
    ({"input_ids": IDS, "label": [[0, 1], None]}, MULTI, {}, "column 'label', row 1: expected a list of 2 numbers"),
    ({"input_ids": IDS, "label": [[0, float("nan")], [1, 0]]}, MULTI, {}, "column 'label', row 0: values must lie in 0..1"),
    ({"input_ids": IDS, "label": [[0, 1], [1, 0]]}, MULTI, {"num_labels": 3}, "expected [rows, 3] numbers"),
    ({"input_ids": IDS, "token_type_ids": [[0, 0], [0, 0, 0, 0]], "label": [0, 1]}, SINGLE, {}, "column 'token_type_ids', row 0: expected 3 segment ids"),
    ({"input_ids": IDS, "token_type_ids": [None, [0] * 4], "label": [0, 1]}, SINGLE, {}, "column 'token_type_ids', row 0: expected a list of integers"),
    ({"input_ids": IDS, "attention_mask": [None, [1] * 4], "label": [0, 1]}, SINGLE, {}, "column 'attention_mask', row 0: expected a list of integers"),
    ({"input_ids": IDS, "attention_mask": [[1, 1, 0], [1] * 4], "label": [0, 1]}, SINGLE, {}, "column 'attention_mask', row 0: padding found"),
    ({"input_ids": IDS, "labels": [[0, 1, 0], [0, 1]]}, TOKENS, {"num_labels": 2}, "column 'labels', row 1: 2 labels for 4 tokens"),
    ({"input_ids": IDS, "labels": [[0, 1, 0], None]}, TOKENS, {"num_labels": 2}, "column 'labels', row 1: expected a list of integers"),
    ({"input_ids": IDS, "labels": [[0, 7, 0], [0] * 4]}, TOKENS, {"num_labels": 2}, "column 'labels', row 0: label 7 is outside 0..1"),
    ({"input_ids": IDS, "start_positions": [1, None], "end_positions": [1, 2]}, QA, {}, "column 'start_positions', row 1: expected an integer"),
    ({"input_ids": IDS, "start_positions": [1, 9], "end_positions": [1, 9]}, QA, {}, "row 1: (9, 9) is not a span inside the window's 4 tokens"),
    ({"input_ids": IDS, "start_positions": [1, 2], "end_positions": [1, 1]}, QA, {}, "row 1: (2, 1) is not a span"),
]  # fmt: skip


@pytest.mark.parametrize("columns, task, options, message", REFUSED)
def test_pack_dataset_refuses_in_one_line_naming_column_and_row(columns, task, options, message):
    with pytest.raises(PackedDatasetError) as refused:
        pack_dataset(Dataset.from_dict(columns), task, 16, verbose=False, **options)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_pack_dataset_refuses_what_is_not_a_map_style_dataset():
    def rows():
        yield {"input_ids": IDS[0], "label": 0}

    with pytest.raises(
        PackedDatasetError, match="an IterableDataset \\(streaming\\) cannot be packed offline"
    ):
        pack_dataset(IterableDataset.from_generator(rows), SINGLE, 16, verbose=False)
    with pytest.raises(PackedDatasetError, match="expected a datasets.Dataset; got dict"):
        pack_dataset({"input_ids": IDS, "label": [0, 1]}, SINGLE, 16, verbose=False)


def test_extra_columns_and_every_label_kind_pack_every_example_once():
    extra = {"text": ["a", "b"], "idx": [10, 11]}
    for task, labels in [
        (SINGLE, {"label": [0, 1]}),
        (MULTI, {"label": [[0.0, 1.0], [1.0, 0.5]]}),
        (TOKENS, {"labels": [[-100, 1, -100], [-100, 0, 1, -100]]}),
        (QA, {"start_positions": [0, 1], "end_positions": [0, 2]}),
    ]:
        packed = pack_dataset(
            Dataset.from_dict({"input_ids": IDS, **labels, **extra}), task, 16, verbose=False
        )
        index = np.asarray(packed["example_index"])
        assert sorted(index[index >= 0].tolist()) == [0, 1], task


# Characters a tokenizer's normalizer rewrites, drops or splits: emoji (with a skin tone
# and a ZWJ sequence), combining accents, precomposed letters, zero-width and no-break
# spaces, CJK, right-to-left text, a control character.
ODD = ["🎉", "👍🏽", "👩‍👩‍👧", "e\u0301", "Å", "\u200b", "\u00a0", "北京", "שלום", "\x07", "ﬁ", "Ⅻ"]


ANSWERS = ["Ångström", "naïve", "Clara", "café", "Zoë", "1999"]


@pytest.fixture(scope="module")
def tokenizer():
    return fast_tokenizer(load_tokenizer(assets.vocab_file())[1])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    before=st.lists(st.sampled_from(ODD + ["the", "game", "was"]), min_size=0, max_size=40),
    answer=st.sampled_from(ANSWERS),
    after=st.lists(st.sampled_from(ODD + ["won", "by"]), min_size=0, max_size=10),
)
def test_answer_labels_map_back_to_the_exact_answer_after_odd_characters(tokenizer, before, answer, after):
    """Windows of 32 tokens (stride 8): wherever a window holds the answer, its labelled
    token span's character offsets are exactly the answer's, however many odd characters
    (each a token, none, or several) come before it."""
    prefix = " ".join(before)
    context = (prefix + " " if prefix else "") + answer + (" " + " ".join(after) if after else "")
    start = len(prefix) + 1 if prefix else 0
    assert context[start : start + len(answer)] == answer
    examples = QaExamples(["q"], ["where?"], [context], [([answer], [start])], ["q"])
    windows = make_windows(examples, tokenizer, 32, 8)
    holding = 0
    for w in range(len(windows)):
        first, last = windows.labels[w]
        if first == 0:  # [CLS]: this window does not hold the whole answer
            continue
        holding += 1
        offsets = windows.offsets[w]
        assert (offsets[first, 0], offsets[last, 1]) == (start, start + len(answer)), (context, w)
    assert holding >= 1


def test_packed_metrics_hands_a_trainer_users_compute_metrics_what_it_reads():
    """compute_metrics written as Trainer users write it (`logits, labels = p`, `p.label_ids`,
    `p.predictions`) gets one row per example in input order (it got a PerExample with
    `.labels` only: AttributeError: no attribute 'label_ids')."""
    from types import SimpleNamespace

    import numpy as np

    from packed_transformers.hf_integration.trainer import packed_metrics

    logits = np.arange(12, dtype=np.float32).reshape(2, 2, 3)  # 2 packs, 2 slots, 3 classes
    index = np.array([[1, 2], [0, -1]])  # example 0 in pack 1; pack 1 slot 1 empty
    labels = np.array([[1, 2], [0, 0]])
    seen = {}

    def compute_metrics(p):
        logits_in_order, label_ids = p
        assert p.predictions is logits_in_order and p.label_ids is label_ids and p[1] is label_ids
        seen["labels"] = label_ids.tolist()
        return {"accuracy": float((logits_in_order.argmax(-1) == label_ids).mean())}

    out = packed_metrics("single_label_classification", compute_metrics)(
        SimpleNamespace(predictions=(logits, index), label_ids=labels)
    )
    assert seen["labels"] == [0, 1, 2] and out == {"accuracy": 1 / 3}  # every argmax is class 2
