"""Documents -> rows of S tokens for causal-LM pretraining, in two layouts. Pure numpy.

* `documents` (document-masked packs): each document is a sequence of its own (attention
  and next-token targets stay inside it, positions restart at 0). A document of more than
  S tokens is split at every S tokens into pieces, each its own sequence. The pieces are
  packed by the histogram packers (packs.tokenized.pack_examples: LPFHP by default, K
  chosen from the lengths), so a row holds whole documents and little padding.
* `concatenated` (MLPerf's reference, Megatron's and NeMo's data): all documents back to
  back (each already ends with EOS), cut every S tokens; one causal stream per row, so a
  token attends to the documents before it in its row and a document crosses rows. The
  tokens after the last full row are left out (counted in `Rows.left_out_tokens`).

Every row carries, per token, the document it came from and its offset in that document
(`document_ids`, `document_offsets`), so `check_rows` proves each document is present
exactly once, token for token, in either layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packed_transformers.packs.errors import PackingBugError, PackingInputError
from packed_transformers.packs.tokenized import pack_examples

LAYOUTS = ("documents", "concatenated")
# K of the documents layout: the smallest of these whose LPFHP plan leaves at most
# MAX_PADDING of the rows' tokens as padding (else the deepest). Web documents average a few
# hundred tokens, so 8192-token rows need K of 32-128; K costs the bucket attention nothing.
DEPTHS = (16, 32, 64, 128, 256, 512)
MAX_PADDING = 0.01


@dataclass
class Rows:
    """Rows [R, S] of one layout. sequence_ids: 1..k per attention segment (documents layout)
    or 1 over the whole row (concatenated), 0 padding; position_ids restart in each segment;
    document_ids: the source document (-1 padding); document_offsets: the token's index in it."""

    input_ids: np.ndarray
    sequence_ids: np.ndarray
    position_ids: np.ndarray
    document_ids: np.ndarray
    document_offsets: np.ndarray
    layout: str
    depth: int  # K: the most segments a row holds
    split_documents: int = 0  # documents longer than S, cut into pieces (documents layout)
    left_out_tokens: int = 0  # tokens after the last full row (concatenated layout)

    FIELDS = ("input_ids", "sequence_ids", "position_ids", "document_ids", "document_offsets")

    @property
    def real_tokens(self) -> int:
        return int((self.sequence_ids > 0).sum())

    def fields(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.FIELDS}


def _empty(rows: int, length: int) -> dict[str, np.ndarray]:
    out = {name: np.zeros((rows, length), np.int32) for name in Rows.FIELDS}
    out["document_ids"][:] = -1
    return out


def pieces_of(lengths: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Documents of `lengths` tokens cut every `length` tokens -> (document, offset, piece
    length) per piece, documents in order."""
    counts = -(-lengths // length)
    document = np.repeat(np.arange(len(lengths)), counts)
    first = np.cumsum(counts) - counts
    offset = (np.arange(counts.sum()) - np.repeat(first, counts)) * length
    return document, offset, np.minimum(lengths[document] - offset, length)


def lm_depth(lengths: np.ndarray, length: int) -> int:
    """K for pieces of `lengths` tokens in rows of `length` (DEPTHS, MAX_PADDING)."""
    from packed_transformers.packs.tokenized import padding_of

    counts = np.bincount(np.asarray(lengths) - 1, minlength=length)
    return next((k for k in DEPTHS if padding_of(counts, length, k) <= MAX_PADDING), DEPTHS[-1])


def document_rows(
    tokens: list[np.ndarray], length: int, depth: int | None, algorithm: str = "lpfhp", seed: int = 0
) -> Rows:
    """The documents layout of `tokens` (one int array per document) in rows of `length`.
    depth: K (None: chosen from the lengths, lm_depth)."""
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    if lengths.size == 0 or lengths.min() < 1:
        raise PackingInputError("expected at least one document, each of at least one token")
    document, offset, piece_length = pieces_of(lengths, length)
    if depth is None:
        depth = lm_depth(piece_length, length)
    table = pack_examples(piece_length, length, depth, algorithm, seed)
    out = _empty(len(table), length)
    # Vectorised over tokens (a per-piece Python loop took minutes at tens of millions of
    # tokens): each row's pieces in slot order, back to back from position 0.
    present = table >= 0
    piece = table[present]  # row-major: row by row, slots in order
    row = np.nonzero(present)[0]
    slot = (np.cumsum(present, 1) - 1)[present]
    size = piece_length[piece]
    before = np.cumsum(size) - size  # tokens of the pieces before, all rows
    first_of_row = np.r_[True, row[1:] != row[:-1]]
    start = before - np.maximum.accumulate(np.where(first_of_row, before, 0))  # tokens before it in its row
    owner = np.repeat(np.arange(len(piece)), size)  # token -> its piece
    within = np.arange(int(size.sum())) - np.repeat(before, size)  # token -> its index in the piece
    place = row[owner] * length + start[owner] + within
    doc, at = document[piece][owner], offset[piece][owner] + within
    lengths_all = np.array([len(t) for t in tokens], dtype=np.int64)
    stream = np.concatenate(tokens)
    out["input_ids"].reshape(-1)[place] = stream[(np.cumsum(lengths_all) - lengths_all)[doc] + at]
    out["sequence_ids"].reshape(-1)[place] = slot[owner] + 1
    out["position_ids"].reshape(-1)[place] = within
    out["document_ids"].reshape(-1)[place] = doc
    out["document_offsets"].reshape(-1)[place] = at
    return Rows(
        **out, layout="documents", depth=table.shape[1], split_documents=int((lengths > length).sum())
    )


def concatenated_rows(tokens: list[np.ndarray], length: int) -> Rows:
    """The reference layout: documents back to back, cut every `length` tokens."""
    stream = np.concatenate(tokens)
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    rows = len(stream) // length
    if rows == 0:
        raise PackingInputError(f"{len(stream)} tokens in all: not one row of {length}")
    used = rows * length
    document = np.repeat(np.arange(len(tokens), dtype=np.int32), lengths)[:used]
    offset = (np.arange(len(stream)) - np.repeat(np.cumsum(lengths) - lengths, lengths))[:used]
    shape = (rows, length)
    return Rows(
        input_ids=stream[:used].reshape(shape).astype(np.int32),
        sequence_ids=np.ones(shape, np.int32),
        position_ids=np.broadcast_to(np.arange(length, dtype=np.int32), shape).copy(),
        document_ids=document.reshape(shape),
        document_offsets=offset.reshape(shape).astype(np.int32),
        layout="concatenated",
        depth=1,
        left_out_tokens=len(stream) - used,
    )


def check_rows(rows: Rows, tokens: list[np.ndarray], present: np.ndarray | None = None) -> None:
    """PackingBugError unless every token of every document is in `rows` exactly once, at
    its offset, with its id (documents layout); the concatenated layout may leave out the
    stream's tail (`left_out_tokens`), and nothing else. Also: positions restart in each
    segment and segments are contiguous runs 1, 2, ... from the row's start.
    present: bool [documents], the documents the rows must hold (None: all); the others
    must be absent (evaluation rows whose left-over documents went back to training)."""
    real = rows.sequence_ids > 0
    if not np.array_equal(real, rows.document_ids >= 0):
        raise PackingBugError("rows: a padding token with a document, or a real token without one")
    document = rows.document_ids[real].astype(np.int64)
    offset = rows.document_offsets[real].astype(np.int64)
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    flat = starts[document] + offset
    # each place in the documents' concatenation at most once (a count per place: linear, where
    # np.unique's hash took half a minute at 15 M tokens)
    if np.any(offset >= lengths[document]) or np.bincount(flat, minlength=1).max(initial=0) > 1:
        raise PackingBugError("rows: a document token placed twice or past its document's end")
    present = np.ones(len(tokens), bool) if present is None else np.asarray(present, bool)
    if not present[document].all():
        raise PackingBugError("rows: a document that should be absent is present")
    expected = lengths[present].sum() - rows.left_out_tokens
    if len(flat) != expected:
        raise PackingBugError(f"rows hold {len(flat)} document tokens, expected {expected}")
    if rows.layout == "concatenated" and len(flat) and flat.max() != expected - 1:
        raise PackingBugError("rows: the concatenated layout left out other tokens than the stream's tail")
    if not np.array_equal(np.concatenate(tokens)[flat], rows.input_ids[real]):
        raise PackingBugError("rows: a token id differs from its document's")
    ids = rows.sequence_ids
    first_of_segment = np.ones_like(real)
    first_of_segment[:, 1:] = ids[:, 1:] != ids[:, :-1]
    restart = np.where(first_of_segment & real, rows.position_ids == 0, True)
    steps = np.where(
        ~first_of_segment & real, rows.position_ids - np.roll(rows.position_ids, 1, 1) == 1, True
    )
    if not (restart.all() and steps.all()):
        raise PackingBugError("rows: positions do not count from 0 in every segment")


def crossing_share(rows: Rows) -> float:
    """The share of causal attention pairs (query i, key j <= i in one segment) whose key is
    another document than the query's: 0 in the documents layout by construction."""
    real = rows.sequence_ids > 0
    if not real.any():
        return 0.0
    segment = (np.nonzero(real)[0] * (int(rows.sequence_ids.max()) + 1) + rows.sequence_ids[real]).astype(
        np.int64
    )
    document = rows.document_ids[real]

    def pairs(boundary: np.ndarray) -> int:
        """Causal pairs inside the runs that `boundary` (True where a run starts) cuts."""
        n = np.diff(np.r_[np.flatnonzero(boundary), len(boundary)]).astype(np.int64)
        return int((n * (n + 1) // 2).sum())

    new_segment = np.r_[True, segment[1:] != segment[:-1]]
    total = pairs(new_segment)
    inside = pairs(new_segment | np.r_[True, document[1:] != document[:-1]])  # a document's run in a segment
    return (total - inside) / total
