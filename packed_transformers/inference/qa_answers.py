"""From start/end logits of windows to one answer per question: the reference's
post-processing (transformers' examples/pytorch/question-answering/utils_qa.py,
postprocess_qa_predictions), vectorised over windows.

    answers = best_answers(start, end, windows, examples, settings)
    answers.text[i]          # the prediction for question i ("" = no answer, v2.0)
    answers.nbest[i]         # with settings.keep_nbest: [{"text", "probability", ...}]

The rules, as the reference applies them per window:
  - candidates: the n_best_size highest start logits x the n_best_size highest end
    logits of the window (ranked over all of the window's tokens, then filtered);
  - kept when both tokens are context tokens, end >= start and the span has at most
    max_answer_length tokens; score = start logit + end logit; text = the context's
    characters from the start token's first to the end token's last;
  - per question, candidates of all its windows sorted by score (stable: window order,
    then start rank, then end rank) and cut to n_best_size;
  - v2.0: the null score is the lowest [CLS] start + end over the question's windows; the
    answer is "" when null score - best span's score > null_score_diff_threshold;
  - no candidate at all: the answer is the reference's placeholder text "empty".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EMPTY = "empty"  # the reference's answer when no span survives the filters


@dataclass(frozen=True)
class AnswerSettings:
    n_best_size: int = 20
    max_answer_length: int = 30  # tokens
    version_2_with_negative: bool = False
    null_score_diff_threshold: float = 0.0
    keep_nbest: bool = False


@dataclass
class Answers:
    text: list[str]  # per question
    score_diff: np.ndarray  # float64 [questions]: null score - best span score (v2.0; nan in v1.1)
    nbest: list[list[dict]] | None
    spans: np.ndarray  # int64 [questions, 2]: the answer's characters [start, end) in its context
    probability: np.ndarray  # float64 [questions]: the answer's share of the n-best softmax


def span_candidates(start: np.ndarray, end: np.ndarray, context: np.ndarray, settings: AnswerSettings):
    """Every window's kept (start, end) pairs, flat and in the reference's order.

    start, end float32 [W, L] (-inf past a window's end); context bool [W, L].
    -> window, start token, end token (int64 [C]) and score float64 [C]."""
    windows, width = start.shape
    n = min(settings.n_best_size, width)
    top_start, top_end = _top(start, n), _top(end, n)
    rows = np.arange(windows)[:, None, None]
    s = np.broadcast_to(top_start[:, :, None], (windows, n, n))
    e = np.broadcast_to(top_end[:, None, :], (windows, n, n))
    keep = context[rows, s] & context[rows, e] & (e >= s) & (e - s + 1 <= settings.max_answer_length)
    window, si, ei = np.nonzero(keep)  # row-major: window, then start rank, then end rank
    s_tok, e_tok = top_start[window, si], top_end[window, ei]
    # float32 sums, as the reference adds its float32 logits: the same ranking on near-ties.
    score = start[window, s_tok] + end[window, e_tok]
    return window, s_tok, e_tok, score


def _top(logits: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest values per row [W, n], largest first: the reference's
    np.argsort(row)[-1 : -n - 1 : -1], row by row (equal logits, which real ones almost
    never are, may come in another order: argsort's default sort is not stable)."""
    return np.argsort(logits, axis=1)[:, ::-1][:, :n]


def best_answers(
    start: np.ndarray,
    end: np.ndarray,
    offsets: np.ndarray,
    example_of_window: np.ndarray,
    contexts: list[str],
    settings: AnswerSettings,
) -> Answers:
    """One answer per question from its windows' logits.

    start, end float32 [W, L] (-inf past a window's end); offsets int [W, L, 2] character
    spans, -1 for non-context tokens; example_of_window int [W] (every question 0..Q-1 has
    at least one window); contexts: the Q context strings."""
    questions = len(contexts)
    context_token = offsets[:, :, 0] >= 0
    window, s_tok, e_tok, score = span_candidates(start, end, context_token, settings)
    example = example_of_window[window]
    # Sort by question, then score descending; lexsort is stable, so equal scores keep
    # the reference's candidate order (window, start rank, end rank).
    order = np.lexsort((-score, example))
    window, s_tok, e_tok, score, example = (a[order] for a in (window, s_tok, e_tok, score, example))
    first = np.searchsorted(example, np.arange(questions))
    stop = np.searchsorted(example, np.arange(questions), side="right")
    nulls = (
        null_answers(start, end, example_of_window, questions) if settings.version_2_with_negative else None
    )

    texts, diffs, nbest = [], np.full(questions, np.nan), [] if settings.keep_nbest else None
    spans, probability = np.zeros((questions, 2), dtype=np.int64), np.zeros(questions)
    for q in range(questions):
        entries = [
            {
                "text": contexts[q][offsets[window[c], s_tok[c], 0] : offsets[window[c], e_tok[c], 1]],
                "start_logit": start[window[c], s_tok[c]],
                "end_logit": end[window[c], e_tok[c]],
                "score": score[c],
                "null": False,
                "span": (int(offsets[window[c], s_tok[c], 0]), int(offsets[window[c], e_tok[c], 1])),
            }
            for c in range(first[q], min(stop[q], first[q] + settings.n_best_size))
        ]
        entries = with_null_and_empty(entries, None if nulls is None else nulls[q], settings.n_best_size)
        scores = np.array([p["score"] for p in entries], dtype=np.float64)
        probabilities = np.exp(scores - scores.max())
        probabilities /= probabilities.sum()
        chosen = 0
        if nulls is not None:
            chosen = next(i for i, p in enumerate(entries) if p["text"] != "")
            best = entries[chosen]
            diffs[q] = float(
                nulls[q]["score"] - best["start_logit"] - best["end_logit"]
            )  # float32, as theirs
            if diffs[q] > settings.null_score_diff_threshold:
                chosen = next(i for i, p in enumerate(entries) if p["null"])
        texts.append(entries[chosen]["text"])
        spans[q] = entries[chosen]["span"]
        probability[q] = probabilities[chosen]
        if nbest is not None:
            nbest.append([
                {"text": p["text"], "probability": float(prob), "start_logit": float(p["start_logit"]),
                 "end_logit": float(p["end_logit"])}
                for p, prob in zip(entries, probabilities)
            ])  # fmt: skip
    return Answers(texts, diffs, nbest, spans, probability)


def null_answers(
    start: np.ndarray, end: np.ndarray, example_of_window: np.ndarray, questions: int
) -> list[dict]:
    """SQuAD v2.0's no-answer candidate of each question: the lowest [CLS] score of its
    windows (the first such window on ties), with that window's start and end logits."""
    cls_score = start[:, 0] + end[:, 0]
    owners = example_of_window
    by_score = np.lexsort((np.arange(len(owners)), cls_score, owners))
    lowest = by_score[np.searchsorted(owners[by_score], np.arange(questions))]
    return [
        {"text": "", "start_logit": start[w, 0], "end_logit": end[w, 0], "score": cls_score[w], "null": True,
         "span": (0, 0)}
        for w in lowest
    ]  # fmt: skip


def with_null_and_empty(entries: list[dict], null: dict | None, n_best_size: int) -> list[dict]:
    """A question's n-best list as the reference builds it: the null answer (v2.0) joins the
    candidates before the cut and is added after the cut when it did not make it; a list with
    no text gets the reference's "empty" entry first."""
    if null is not None:
        entries = sorted(entries + [null], key=lambda p: -p["score"])[:n_best_size]
        if not any(p["null"] for p in entries):
            entries.append(null)
    if not entries or (len(entries) == 1 and entries[0]["text"] == ""):
        zero = np.float32(0.0)
        empty = {
            "text": EMPTY,
            "start_logit": zero,
            "end_logit": zero,
            "score": zero,
            "null": False,
            "span": (0, 0),
        }
        entries.insert(0, empty)
    return entries
