"""Token classification (NER, POS) for predict and the server: texts -> the folder's
tokenizer (offsets kept) -> packed rows -> per-token logits -> entities shaped as
transformers' token-classification pipeline returns them with aggregation_strategy="none":

    [{"entity": "B-PER", "score": 0.98, "index": 1, "word": "Ada", "start": 0, "end": 3}, ...]

one dict per token that is not special and whose label is not ignored ("O" by default, as
the pipeline's ignore_labels), `index` its position in the tokenized text, `score` the
softmax of its best label, `start`/`end` character offsets in the text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packed_transformers.data.classification_data import ExampleError, encode_within
from packed_transformers.data.text_rule import check_text

IGNORE_LABELS = ("O",)


@dataclass
class TaggedTexts:
    """Texts tokenized for tagging: per text its int64 ids and type ids, character offsets
    [n_tokens, 2], the special-token mask and the token strings; `truncated` texts cut."""

    token_ids: list
    segment_ids: list
    offsets: list
    special: list
    words: list
    truncated: int


def tokenize_for_tags(
    texts: list[str], where: list[str], tokenizer, max_length: int, truncate: bool = True
) -> TaggedTexts:
    """`tokenizer`: a `tokenizers.Tokenizer` (the folder's tokenizer.json, or the WordPiece
    of its vocab.txt). Too long without `truncate`: ExampleError naming the text."""
    for text, place in zip(texts, where):
        check_text(text, f"{place}: the text")
    encoded, long = encode_within(tokenizer, texts, max_length, truncate)
    if long and not truncate:
        raise ExampleError(
            f"{where[long[0]]}: {len(encoded[long[0]].ids)} tokens; the model takes at most {max_length}"
        )
    return TaggedTexts(
        [np.asarray(e.ids, dtype=np.int64) for e in encoded],
        [np.asarray(e.type_ids, dtype=np.int64) for e in encoded],
        [np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2) for e in encoded],
        [np.asarray(e.special_tokens_mask, dtype=bool) for e in encoded],
        [list(e.tokens) for e in encoded],
        len(long),
    )


def entities(
    logits: np.ndarray, tagged: TaggedTexts, i: int, labels: list[str], ignore=IGNORE_LABELS
) -> list[dict]:
    """Text i's per-token logits float32 [n_tokens, C] -> the pipeline's entity dicts."""
    shifted = logits - logits.max(-1, keepdims=True)
    probabilities = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
    best = probabilities.argmax(-1)
    out = []
    for position in range(len(logits)):
        label = labels[int(best[position])]
        if tagged.special[i][position] or label in ignore:
            continue
        start, end = tagged.offsets[i][position]
        out.append({
            "entity": label, "score": float(probabilities[position, best[position]]), "index": position,
            "word": tagged.words[i][position], "start": int(start), "end": int(end),
        })  # fmt: skip
    return out
