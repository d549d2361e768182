"""Documents -> masked sentence-pair instances, drawing random numbers exactly as the MLPerf
reference generator does (mlcommons/training `create_pretraining_data.py`, which is
google-research/bert's without whole-word masking).

The order of `random.Random` calls IS the contract: with the same seed and the same token ids
the output is byte-identical to the reference's. tests/data/test_reference_generator.py runs the
reference itself side by side; a reordered draw anywhere below fails it. The calls, in order:

1. `shuffle(documents)` once, before anything else.
2. Per document, per dupe pass: `random() < short_seq_prob`, then `randint(2, S - 3)` if short.
3. Per chunk: `randint(1, len(chunk) - 1)` for the A/B split (chunks of 2+ sentences);
   `random() < 0.5` for random-next (skipped when the chunk has one sentence: then it is random
   next for sure); up to 10 `randint` for the other document (stopping at the first that
   differs; with one document all ten are drawn); `randint` for its first sentence.
4. Truncation: one `random() < 0.5` per removed token (front or back of the longer segment).
5. Masking: `shuffle(candidate positions)`; per chosen position `random() < 0.8` ([MASK]),
   else `random() < 0.5` (keep), else `randint(0, V - 1)` for the random word.
6. `shuffle(instances)` once, at the end (done by the caller, on an index list: a shuffle's
   draws depend only on the list's length).
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Recipe:
    max_seq_length: int = 512
    max_predictions_per_seq: int = 76
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1


@dataclass(frozen=True)
class SpecialIds:
    cls: int
    sep: int
    mask: int
    vocab_size: int  # random words are drawn from ids 0 .. vocab_size - 1

    @classmethod
    def from_vocab(cls, vocab: dict[str, int]) -> SpecialIds:
        return cls(vocab["[CLS]"], vocab["[SEP]"], vocab["[MASK]"], len(vocab))


class InstanceStore:
    """Instances kept compactly (a flat token array and offsets, not a Python list per
    instance): one MLPerf part is ~313 k instances of up to 512 tokens."""

    def __init__(self, vocab_size: int):
        self.typecode = "h" if vocab_size <= 1 << 15 else "i"
        self.tokens = array(self.typecode)
        self.ends: list[int] = []
        self.a_lengths: list[int] = []  # tokens of segment A, [CLS] and its [SEP] included
        self.positions: list[list[int]] = []
        self.labels: list[list[int]] = []
        self.random_next: list[bool] = []

    def __len__(self) -> int:
        return len(self.ends)

    def add(self, tokens, a_length, positions, labels, random_next) -> None:
        self.tokens.extend(tokens)
        self.ends.append(len(self.tokens))
        self.a_lengths.append(a_length)
        self.positions.append(positions)
        self.labels.append(labels)
        self.random_next.append(random_next)

    def arrays(self, rows: list[int], s: int, p: int) -> dict[str, np.ndarray]:
        """The six MLPerf fields of the given instances, in that order: [n, S] / [n, P] / [n]."""
        n = len(rows)
        out = {
            "input_ids": np.zeros((n, s), np.int32),
            "input_mask": np.zeros((n, s), np.int8),
            "segment_ids": np.zeros((n, s), np.int8),
            "masked_lm_positions": np.zeros((n, p), np.int32),
            "masked_lm_ids": np.zeros((n, p), np.int32),
            "next_sentence_labels": np.zeros(n, np.int8),
        }
        flat = np.frombuffer(self.tokens, dtype=np.dtype(self.typecode))
        for row, index in enumerate(rows):
            start = self.ends[index - 1] if index else 0
            length = self.ends[index] - start
            count = len(self.positions[index])
            out["input_ids"][row, :length] = flat[start : start + length]
            out["input_mask"][row, :length] = 1
            out["segment_ids"][row, self.a_lengths[index] : length] = 1
            out["masked_lm_positions"][row, :count] = self.positions[index]
            out["masked_lm_ids"][row, :count] = self.labels[index]
            out["next_sentence_labels"][row] = self.random_next[index]
        return out


def truncate_pair(tokens_a: list, tokens_b: list, max_tokens: int, rng: random.Random) -> None:
    """Trim the longer segment (B on ties) one token at a time, front or back at random."""
    while len(tokens_a) + len(tokens_b) > max_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def mask_tokens(tokens: list[int], a_length: int, recipe: Recipe, ids: SpecialIds, rng: random.Random):
    """Mask in place. -> (positions ascending, original ids there). [CLS] (0), the middle
    [SEP] (a_length - 1) and the last [SEP] are never candidates."""
    last = len(tokens) - 1
    candidates = [i for i in range(1, last) if i != a_length - 1]
    rng.shuffle(candidates)
    count = min(recipe.max_predictions_per_seq, max(1, int(round(len(tokens) * recipe.masked_lm_prob))))
    chosen = candidates[:count]
    labels_at = {}
    for position in chosen:
        labels_at[position] = tokens[position]
        if rng.random() < 0.8:
            tokens[position] = ids.mask
        elif rng.random() < 0.5:
            pass  # shown as itself
        else:
            tokens[position] = rng.randint(0, ids.vocab_size - 1)
    positions = sorted(chosen)
    return positions, [labels_at[p] for p in positions]


def add_document_instances(
    documents: list[list[list[int]]],
    index: int,
    recipe: Recipe,
    ids: SpecialIds,
    rng: random.Random,
    store: InstanceStore,
) -> None:
    """The sentence pairs of documents[index] (a list of sentences of token ids) into `store`."""
    document = documents[index]
    max_tokens = recipe.max_seq_length - 3  # room for [CLS] A [SEP] B [SEP]
    target = max_tokens
    if rng.random() < recipe.short_seq_prob:
        target = rng.randint(2, max_tokens)
    chunk: list[list[int]] = []
    chunk_length = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        chunk_length += len(document[i])
        if i == len(document) - 1 or chunk_length >= target:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            tokens_a = [t for sentence in chunk[:a_end] for t in sentence]
            if len(chunk) == 1 or rng.random() < 0.5:
                random_next = True
                target_b = target - len(tokens_a)
                for _ in range(10):
                    other = rng.randint(0, len(documents) - 1)
                    if other != index:
                        break
                other_document = documents[other]
                tokens_b = []
                for sentence in other_document[rng.randint(0, len(other_document) - 1) :]:
                    tokens_b.extend(sentence)
                    if len(tokens_b) >= target_b:
                        break
                i -= len(chunk) - a_end  # the sentences not used go back for the next chunk
            else:
                random_next = False
                tokens_b = [t for sentence in chunk[a_end:] for t in sentence]
            truncate_pair(tokens_a, tokens_b, max_tokens, rng)
            # Both are non-empty: sentences are non-empty and truncation trims the longer one.
            tokens = [ids.cls, *tokens_a, ids.sep, *tokens_b, ids.sep]
            a_length = len(tokens_a) + 2
            positions, labels = mask_tokens(tokens, a_length, recipe, ids, rng)
            store.add(tokens, a_length, positions, labels, random_next)
            chunk, chunk_length = [], 0
        i += 1


def create_instances(
    documents: list[list[list[int]]], dupe_factor: int, recipe: Recipe, ids: SpecialIds, rng: random.Random
) -> tuple[InstanceStore, list[int]]:
    """Steps 2-6 for documents already shuffled. -> (store, the final order of its rows)."""
    store = InstanceStore(ids.vocab_size)
    for _ in range(dupe_factor):
        for index in range(len(documents)):
            add_document_instances(documents, index, recipe, ids, rng, store)
    order = list(range(len(store)))
    rng.shuffle(order)
    return store, order
