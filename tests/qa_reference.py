"""The judge for answer post-processing: transformers' reference, as a plain loop.

This follows `postprocess_qa_predictions` in transformers'
examples/pytorch/question-answering/utils_qa.py (the rules run_qa.py users compare with),
rule for rule, one window and one (start, end) pair at a time:
  - per window: null score = start[0] + end[0]; the lowest over a question's windows is
    its null prediction (the first window on ties: it replaces only on a strictly lower
    score);
  - start_indexes = np.argsort(start)[-1 : -n_best_size - 1 : -1] (same for end);
  - skip pairs whose offsets are None (not context), end < start, or more than
    max_answer_length tokens; otherwise a candidate with score start + end and text
    context[offset[start][0] : offset[end][1]];
  - v2.0: the null prediction joins the candidates; sort by score (descending, stable);
    keep n_best_size; v2.0: add the null prediction again if it fell out;
  - no candidate, or only an empty one: insert {"text": "empty", scores 0} first;
  - softmax of the kept scores = probabilities;
  - v1.1: the answer is the first; v2.0: score_diff = null score - (best non-empty
    candidate's start + end logit), "" when score_diff > null_score_diff_threshold.
Written from the reference's documented behaviour; test code only.
"""

from __future__ import annotations

import numpy as np


def reference_postprocess(
    windows_of_question: list[list[int]],
    start_logits: list[np.ndarray],
    end_logits: list[np.ndarray],
    offsets: list[list[tuple[int, int] | None]],
    contexts: list[str],
    n_best_size=20,
    max_answer_length=30,
    version_2_with_negative=False,
    null_score_diff_threshold=0.0,
):
    """-> (answers [text per question], score_diffs, nbest lists of dicts)."""
    answers, diffs, nbests = [], [], []
    for q, window_ids in enumerate(windows_of_question):
        min_null = None
        prelim = []
        for w in window_ids:
            s_logits, e_logits, offset = start_logits[w], end_logits[w], offsets[w]
            null_score = s_logits[0] + e_logits[0]
            if min_null is None or min_null["score"] > null_score:
                min_null = {
                    "offsets": (0, 0),
                    "score": null_score,
                    "start_logit": s_logits[0],
                    "end_logit": e_logits[0],
                }
            start_indexes = np.argsort(s_logits)[-1 : -n_best_size - 1 : -1].tolist()
            end_indexes = np.argsort(e_logits)[-1 : -n_best_size - 1 : -1].tolist()
            for si in start_indexes:
                for ei in end_indexes:
                    if si >= len(offset) or ei >= len(offset) or offset[si] is None or offset[ei] is None:
                        continue
                    if ei < si or ei - si + 1 > max_answer_length:
                        continue
                    prelim.append(
                        {
                            "offsets": (offset[si][0], offset[ei][1]),
                            "score": s_logits[si] + e_logits[ei],
                            "start_logit": s_logits[si],
                            "end_logit": e_logits[ei],
                        }
                    )
        if version_2_with_negative and min_null is not None:
            prelim.append(min_null)
            null_score = min_null["score"]
        predictions = sorted(prelim, key=lambda x: x["score"], reverse=True)[:n_best_size]
        if (
            version_2_with_negative
            and min_null is not None
            and not any(p["offsets"] == (0, 0) for p in predictions)
        ):
            predictions.append(min_null)
        context = contexts[q]
        for p in predictions:
            first, last = p.pop("offsets")
            p["text"] = context[first:last]
        if len(predictions) == 0 or (len(predictions) == 1 and predictions[0]["text"] == ""):
            predictions.insert(0, {"text": "empty", "start_logit": 0.0, "end_logit": 0.0, "score": 0.0})
        scores = np.array([p.pop("score") for p in predictions])
        exp = np.exp(scores - np.max(scores))
        probs = exp / exp.sum()
        for prob, p in zip(probs, predictions):
            p["probability"] = prob
        if not version_2_with_negative:
            answers.append(predictions[0]["text"])
            diffs.append(float("nan"))
        else:
            i = 0
            while predictions[i]["text"] == "":
                i += 1
            best = predictions[i]
            score_diff = null_score - best["start_logit"] - best["end_logit"]
            diffs.append(float(score_diff))
            answers.append("" if score_diff > null_score_diff_threshold else best["text"])
        nbests.append(predictions)
    return answers, diffs, nbests
