"""Answer post-processing: equal to the reference's loop (tests/qa_reference.py) on the
same logits, answers always inside their context, window order irrelevant; and the
official SQuAD metric definitions on hand-computed cases."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packed_transformers.data.squad_metrics import exact_match, f1, normalize_answer, squad_scores
from packed_transformers.inference.qa_answers import EMPTY, AnswerSettings, best_answers

from ..qa_reference import reference_postprocess

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa", "mu"]


def synthetic_questions(rng, questions, max_words, window_context, stride, question_tokens=3):
    """Contexts of random words, cut into overlapping windows as the windowing does:
    [CLS] question [SEP] context-part [SEP]; offsets -1 outside the context part.
    -> (contexts, per-window offsets [L, 2], example_of_window)."""
    contexts, offsets, owners = [], [], []
    for q in range(questions):
        words = list(rng.choice(WORDS, size=int(rng.integers(1, max_words + 1))))
        context = " ".join(words)
        spans, at = [], 0
        for word in words:
            spans.append((at, at + len(word)))
            at += len(word) + 1
        contexts.append(context)
        first = 0
        while True:
            part = spans[first : first + window_context]
            head = [(-1, -1)] * (1 + question_tokens + 1)
            offsets.append(np.array(head + part + [(-1, -1)], dtype=np.int32))
            owners.append(q)
            if first + window_context >= len(spans):
                break
            first += window_context - stride
    return contexts, offsets, np.array(owners)


def stack(values, width, fill):
    out = np.full((len(values), width, *values[0].shape[1:]), fill, dtype=values[0].dtype)
    for i, v in enumerate(values):
        out[i, : len(v)] = v
    return out


def run_both(seed, questions, version_2, n_best, max_answer, threshold=0.0, permute=False):
    rng = np.random.default_rng(seed)
    contexts, offsets, owners = synthetic_questions(rng, questions, 40, window_context=12, stride=4)
    lengths = [len(o) for o in offsets]
    # Distinct logits: the reference ranks with np.argsort, whose order of equal values is
    # not defined; real logits are never equal.
    pool = rng.permutation(sum(lengths) * 2).astype(np.float32) / 7.0 - 40
    starts, ends, at = [], [], 0
    for n in lengths:
        starts.append(pool[at : at + n])
        ends.append(pool[at + n : at + 2 * n])
        at += 2 * n
    order = np.arange(len(offsets))
    if permute:
        order = rng.permutation(len(offsets))
    width = max(lengths)
    config = AnswerSettings(n_best, max_answer, version_2, threshold, keep_nbest=True)
    ours = best_answers(
        stack([starts[i] for i in order], width, -np.inf),
        stack([ends[i] for i in order], width, -np.inf),
        stack([offsets[i] for i in order], width, -1),
        owners[order],
        contexts,
        config,
    )
    windows_of = [[w for w in range(len(offsets)) if owners[w] == q] for q in range(questions)]
    theirs = reference_postprocess(
        windows_of,
        starts,
        ends,
        [[None if s < 0 else (int(s), int(e)) for s, e in o] for o in offsets],
        contexts,
        n_best,
        max_answer,
        version_2,
        threshold,
    )
    return ours, theirs, contexts, offsets


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    questions=st.integers(1, 6),
    version_2=st.booleans(),
    n_best=st.integers(1, 25),
    max_answer=st.integers(1, 12),
    threshold=st.sampled_from([0.0, -5.0, 5.0]),
)
def test_answers_equal_the_reference_loop(seed, questions, version_2, n_best, max_answer, threshold):
    ours, (texts, diffs, nbests), _, _ = run_both(seed, questions, version_2, n_best, max_answer, threshold)
    assert ours.text == texts
    if version_2:
        np.testing.assert_allclose(ours.score_diff, diffs, rtol=0, atol=1e-5)
    for mine, reference in zip(ours.nbest, nbests):
        assert [p["text"] for p in mine] == [p["text"] for p in reference]
        np.testing.assert_allclose(
            [p["probability"] for p in mine], [p["probability"] for p in reference], rtol=1e-6, atol=1e-9
        )


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), questions=st.integers(1, 5), max_answer=st.integers(1, 6))
def test_an_answer_is_a_context_substring_within_max_answer_length_words(seed, questions, max_answer):
    ours, _, contexts, _ = run_both(seed, questions, False, 20, max_answer)
    for text, context in zip(ours.text, contexts):
        if text == EMPTY and EMPTY not in context:
            continue  # the reference's placeholder when no span survives
        assert text in context and text.strip() == text and text
        assert len(text.split()) <= max_answer  # one token per word here


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), questions=st.integers(1, 5), version_2=st.booleans())
def test_window_order_changes_nothing(seed, questions, version_2):
    straight, _, _, _ = run_both(seed, questions, version_2, 20, 30)
    shuffled, _, _, _ = run_both(seed, questions, version_2, 20, 30, permute=True)
    assert straight.text == shuffled.text
    np.testing.assert_array_equal(straight.score_diff, shuffled.score_diff)


def test_long_context_answer_in_later_windows_by_hand():
    """One question, a context of 10 words in 3 windows of 4 context tokens (stride 1):
    window 0 = words 0-3, window 1 = words 3-6, window 2 = words 6-9. The best start is
    in window 1 (word 5), the best end in window 2 (word 8); no window holds both, so the
    answer is the best pair inside one window: window 2's words 6..8 (score 3 + 4) beats
    window 1's words 5..6 (score 5 + 1)."""
    words = [f"w{i}" for i in range(10)]
    context = " ".join(words)
    spans = [(3 * i, 3 * i + 2) for i in range(10)]
    head = [(-1, -1)] * 3  # [CLS] q [SEP]
    windows = [list(range(0, 4)), list(range(3, 7)), list(range(6, 10))]
    offsets = [np.array(head + [spans[i] for i in w] + [(-1, -1)], dtype=np.int32) for w in windows]
    start = np.full((3, 8), -10.0, dtype=np.float32)
    end = np.full((3, 8), -10.0, dtype=np.float32)
    start[1, 3 + 2] = 5.0  # word 5 in window 1
    end[1, 3 + 3] = 1.0  # word 6 in window 1
    start[2, 3 + 0] = 3.0  # word 6 in window 2
    end[2, 3 + 2] = 4.0  # word 8 in window 2
    answers = best_answers(
        start, end, np.stack(offsets), np.zeros(3, dtype=np.int64), [context], AnswerSettings()
    )
    assert answers.text == ["w6 w7 w8"]
    # With a two-token limit, window 2's span is too long: window 1's "w5 w6" wins.
    short = best_answers(
        start,
        end,
        np.stack(offsets),
        np.zeros(3, dtype=np.int64),
        [context],
        AnswerSettings(max_answer_length=2),
    )
    assert short.text == ["w5 w6"]
    # v2.0: the null score is the lowest [CLS] start + end over the windows (-20 here);
    # -20 - (3 + 4) = -27 is below the threshold 0, so the span stands; a threshold of
    # -30 makes the answer "".
    v2 = AnswerSettings(version_2_with_negative=True, null_score_diff_threshold=-30.0)
    empty = best_answers(start, end, np.stack(offsets), np.zeros(3, dtype=np.int64), [context], v2)
    assert empty.text == [""] and empty.score_diff[0] == pytest.approx(-27.0)


# ----- the official metric definitions ----------------------------------------------------
def test_normalisation_drops_case_punctuation_articles_and_extra_space():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("an apple, a pear and THE plum") == "apple pear and plum"
    assert normalize_answer("theatre anthem") == "theatre anthem"  # articles only as whole words
    assert normalize_answer("  \tA\n") == ""


def test_exact_match_and_f1_by_hand():
    assert exact_match("the Time Warner", "Time Warner.") == 1
    assert f1("Time Warner profits", "Warner") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert f1("x b b", "b b c") == pytest.approx(2 / 3)  # two shared tokens of three each
    assert f1("a b b", "b b c") == pytest.approx(0.8)  # "a" is an article: precision 1, recall 2/3
    assert f1("x", "y") == 0.0
    assert f1("", "") == 1.0 and f1("the", "") == 1.0  # v2.0: both empty after normalisation
    assert f1("", "", version_2=False) == 0.0


def test_squad_v1_scores_take_the_best_gold_answer_and_count_missing_as_zero():
    gold = {"q1": ["Denver Broncos", "the Broncos"], "q2": ["1990"], "q3": ["Paris"]}
    predictions = {"q1": "Broncos", "q2": "in 1990"}
    scores = squad_scores(predictions, gold)
    # q1: EM 0, F1 max(2/3, 1.0) = 1.0 (normalised "broncos" equals "broncos");
    # q2: EM 0, F1 2 * (1/2 * 1) / (1/2 + 1) = 2/3; q3 missing: 0.
    assert scores["exact_match"] == pytest.approx(100 * 1 / 3)
    assert scores["f1"] == pytest.approx(100 * (1.0 + 2 / 3) / 3)


def test_squad_v2_scores_unanswerable_questions_and_split_has_no_answer():
    gold = {"a": ["Denver"], "b": [], "c": []}
    predictions = {"a": "Denver", "b": "", "c": "Denver"}
    scores = squad_scores(predictions, gold, version_2=True)
    assert scores["exact"] == pytest.approx(200 / 3) and scores["f1"] == pytest.approx(200 / 3)
    assert scores["HasAns_exact"] == 100.0 and scores["HasAns_total"] == 1
    assert scores["NoAns_exact"] == 50.0 and scores["NoAns_total"] == 2
