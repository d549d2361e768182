"""SQuAD's official metrics, by the definitions of its evaluation scripts (evaluate-v1.1.py,
evaluate-v2.0.py): answer normalisation, exact match, token F1, the maximum over the gold
answers, in percent.

    scores = squad_scores(predictions, gold, version_2=False)
    scores["exact_match"], scores["f1"]                  # v1.1
    scores["exact"], scores["f1"], scores["HasAns_f1"]...  # v2.0 (its keys)

Normalisation: lower case, drop punctuation (string.punctuation), drop the articles a / an /
the as whole words, collapse whitespace. v1.1 scores every question of the gold set
(a missing prediction scores 0); v2.0 gives a question without gold answers the single
gold answer "" (so only an empty prediction is right) and reports answerable (HasAns) and
unanswerable (NoAns) questions apart, as its script does.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> int:
    return int(normalize_answer(prediction) == normalize_answer(gold))


def f1(prediction: str, gold: str, version_2: bool = True) -> float:
    """Token F1 of the normalised answers. When either is empty, v2.0 scores 1 if both are
    and v1.1 scores 0 (it has no shared token)."""
    predicted = normalize_answer(prediction).split()
    truth = normalize_answer(gold).split()
    if not predicted or not truth:
        return float(version_2 and predicted == truth)
    same = sum((Counter(predicted) & Counter(truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(truth)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: dict[str, str], gold: dict[str, list[str]], version_2: bool = False) -> dict:
    """predictions {question id: answer text}; gold {question id: gold answer texts}
    (an empty list: unanswerable). Percentages, as the official scripts print them."""
    if not version_2:
        em = f1_sum = 0.0
        for qid, answers in gold.items():
            if qid not in predictions:
                continue  # the official script counts it, scoring 0
            em += max(exact_match(predictions[qid], a) for a in answers)
            f1_sum += max(f1(predictions[qid], a, version_2=False) for a in answers)
        total = len(gold)
        return {"exact_match": 100.0 * em / total, "f1": 100.0 * f1_sum / total, "total": total}
    exact, f1s, has_answer = {}, {}, {}
    for qid, answers in gold.items():
        if qid not in predictions:
            continue  # the v2.0 script skips it (and prints it)
        kept = [a for a in answers if normalize_answer(a)] or [""]
        has_answer[qid] = bool(answers)
        exact[qid] = max(exact_match(predictions[qid], a) for a in kept)
        f1s[qid] = max(f1(predictions[qid], a) for a in kept)
    out = _averages(exact, f1s, list(exact))
    for name, wanted in (("HasAns", True), ("NoAns", False)):
        ids = [qid for qid in exact if has_answer[qid] == wanted]
        if ids:
            out.update({f"{name}_{key}": value for key, value in _averages(exact, f1s, ids).items()})
    return out


def _averages(exact: dict, f1s: dict, ids: list[str]) -> dict:
    total = len(ids)
    return {
        "exact": 100.0 * sum(exact[i] for i in ids) / total if total else 0.0,
        "f1": 100.0 * sum(f1s[i] for i in ids) / total if total else 0.0,
        "total": total,
    }
