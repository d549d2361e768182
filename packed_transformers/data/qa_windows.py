"""Question-answering windows ("features"): the rules of transformers' reference
(examples/pytorch/question-answering, run_qa.py), written for packing.

    windows = make_windows(examples, tokenizer, max_sequence_length=384, doc_stride=128)

One question becomes one or more windows `[CLS] question [SEP] context-part [SEP]`
(segment ids 0 / 1): the question is left-stripped and never truncated; a context too
long for one window overflows into further windows that overlap by `doc_stride` tokens
(the fast tokenizer's own overflow). No padding: a window is exactly its tokens, and the
batching mode (padded, dynamic, uniform, packed) decides the rest.

Labels, by the reference's rule: the first gold answer's character span mapped to token
positions inside the window, or (0, 0), the window's [CLS], when the window does not hold
the whole answer (and for unanswerable v2.0 questions). Offsets are kept for context
tokens only (-1 elsewhere), so that a predicted span always maps back into the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packed_transformers.data.classification_data import ExampleError
from packed_transformers.data.qa_data import QaExamples

NOT_CONTEXT = -1  # offset value of question, special and padding tokens
CHUNK = 2048  # questions per tokenizer call (bounded memory, same result)


@dataclass
class QaWindows:
    """token_ids[w], segment_ids[w]: int32 [length_w]; offsets[w]: int32 [length_w, 2]
    character (start, end) in the question's context, -1 for non-context tokens;
    labels int64 [W, 2] (start, end) positions inside the window; example_of_window
    int64 [W], the question each window came from (input order, ascending)."""

    token_ids: list[np.ndarray]
    segment_ids: list[np.ndarray]
    offsets: list[np.ndarray]
    labels: np.ndarray
    example_of_window: np.ndarray
    truncated: int = 0  # windows never truncate text: overflow makes more windows

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(t) for t in self.token_ids], dtype=np.int64)


def fast_tokenizer(vocab: dict):
    """transformers' BertTokenizerFast over `vocab` (token -> id), uncased: the tokenizer
    the reference uses (AutoTokenizer of a BERT folder), with overflow and offsets."""
    from transformers import BertTokenizerFast

    # vocab= (a dict), not vocab_file=: the latter is ignored under transformers 5.x.
    return BertTokenizerFast(vocab=vocab, do_lower_case=True)


def check_window_room(examples: QaExamples, tokenizer, max_sequence_length: int, doc_stride: int) -> None:
    """Every question must leave more than doc_stride context tokens per window (the
    tokenizer's overflow needs it; it aborts the process otherwise)."""
    lengths = [len(ids) for ids in tokenizer(examples.questions, add_special_tokens=False)["input_ids"]]
    limit = max_sequence_length - doc_stride - 4
    for length, where in zip(lengths, examples.where):
        if length > limit:
            raise ExampleError(
                f"{where}: field 'question': {length} tokens; with max_sequence_length "
                f"{max_sequence_length} and doc_stride {doc_stride} a question may have at most {limit}"
            )


def make_windows(
    examples: QaExamples, tokenizer, max_sequence_length: int = 384, doc_stride: int = 128
) -> QaWindows:
    """All windows of all questions, in question order."""
    if not 0 <= doc_stride < max_sequence_length - 4:
        raise ExampleError(f"doc_stride {doc_stride} must be in 0..{max_sequence_length - 5}")
    questions = [q.lstrip() for q in examples.questions]
    check_window_room(examples, tokenizer, max_sequence_length, doc_stride)
    token_ids, segment_ids, offsets, labels, owners = [], [], [], [], []
    for first in range(0, len(questions), CHUNK):
        last = min(first + CHUNK, len(questions))
        encoded = tokenizer(
            questions[first:last],
            examples.contexts[first:last],
            truncation="only_second",
            max_length=max_sequence_length,
            stride=doc_stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            return_token_type_ids=True,
        )
        for w, ids in enumerate(encoded["input_ids"]):
            example = first + encoded["overflow_to_sample_mapping"][w]
            sequence = np.array([-1 if s is None else s for s in encoded.sequence_ids(w)])
            spans = np.asarray(encoded["offset_mapping"][w], dtype=np.int32).reshape(-1, 2)
            spans[sequence != 1] = NOT_CONTEXT
            token_ids.append(np.asarray(ids, dtype=np.int32))
            segment_ids.append(np.asarray(encoded["token_type_ids"][w], dtype=np.int32))
            offsets.append(spans)
            labels.append(answer_positions(spans, examples.answers[example]))
            owners.append(example)
    return QaWindows(
        token_ids,
        segment_ids,
        offsets,
        np.asarray(labels, dtype=np.int64).reshape(-1, 2),
        np.asarray(owners, dtype=np.int64),
    )


def answer_positions(spans: np.ndarray, answers) -> tuple[int, int]:
    """(start, end) token positions of the first gold answer inside one window, or (0, 0)
    ([CLS]) when the window does not hold all of it or there is none.

    spans int [L, 2]: character offsets of the window's tokens, -1 for non-context ones.
    The first context token whose start is <= the answer's start and the last whose end is
    >= the answer's end bound the span: the reference's rule, which keeps a token that
    straddles an answer edge inside the span."""
    if not answers or not answers[0]:
        return 0, 0
    start_char = answers[1][0]
    end_char = start_char + len(answers[0][0])
    context = np.flatnonzero(spans[:, 0] >= 0)
    first, last = context[0], context[-1]
    if not (spans[first, 0] <= start_char and spans[last, 1] >= end_char):
        return 0, 0
    starts, ends = spans[context, 0], spans[context, 1]
    start = context[np.flatnonzero(starts <= start_char)[-1]]
    end = context[np.flatnonzero(ends >= end_char)[0]]
    return int(start), int(end)
