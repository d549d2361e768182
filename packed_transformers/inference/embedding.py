"""Packed sentence embeddings: a sentence-transformers (or any BERT) folder, texts in, a
float32 [n, D] array out, row i for text i.

    encoder = load_encoder(folder)                       # reads modules.json, pooling, Normalize
    vectors = encode(["a text", "another"], encoder)     # numpy [2, D], packed batches
    vectors = packed_encode(st_model, texts)             # from a SentenceTransformer object

A text goes: tokenizer (the folder's tokenizer.json, else vocab.txt; truncated to
max_seq_length, as sentence-transformers does) -> token ids -> batch tables
(packs.batching: packed, length-sorted or padded) -> rows (packs.rows.pack_rows) ->
model.embedding.PackedBertForEmbedding (per-sequence pooling) -> back to input order.
Texts are encoded in chunks (`chunk_texts`, or about `chunk_seconds` of work each: ChunkSizes),
so memory is bounded by a chunk, never by the input; `iter_encode` yields one chunk's array at a
time for streaming writers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from packed_transformers.common.choices import EMBED_BATCHING
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.door.loaded import LoadedModel
from packed_transformers.inference.options import InferenceOptions
from packed_transformers.inference.runner import runner_of
from packed_transformers.packs.batching import Batcher, BatchingSpec, width_groups
from packed_transformers.packs.rows import unpack_outputs


def packed_encode(st_model, texts: list[str], **options) -> np.ndarray:
    """sentence-transformers' `model.encode(texts)` (numpy float32 [n, D]), packed: the same
    vectors, computed on packs. The LoadedModel is built once per model object and kept on it."""
    from packed_transformers.door.embedding_folder import encoder_from_sentence_transformer

    encoder = getattr(st_model, "_packed_encoder", None)
    if encoder is None:
        encoder = encoder_from_sentence_transformer(st_model)
        st_model._packed_encoder = encoder
    device = str(next(encoder.model.parameters()).device.type)
    return encode(texts, encoder, InferenceOptions.for_embedding(device=device, **options))


def __getattr__(name: str):
    """load_encoder and encoder_from_sentence_transformer, read from here too, imported when
    asked for (they import torch; this module runs exported folders without it)."""
    if name in ("load_encoder", "encoder_from_sentence_transformer"):
        from packed_transformers.door import embedding_folder

        return getattr(embedding_folder, name)
    raise AttributeError(name)


def run_tables(
    encoder: LoadedModel, token_ids: list, tables: Iterable[np.ndarray], width_of, options: InferenceOptions
):
    """Forward every batch table; -> (per-slot embeddings [rows, K, D], example_index [rows, K])
    per batch. The model pools; normalization is the caller's."""
    runner = runner_of(encoder, options.device, options.dtype, options.compile, options.runtime)
    for batch in runner.run(token_ids, tables, width_of, None, ("embeddings",)):
        yield batch.outputs["embeddings"], batch.rows["example_index"]


def embed_token_ids(encoder: LoadedModel, token_ids: list, options: InferenceOptions) -> np.ndarray:
    """Token id arrays -> float32 [n, D] in input order (normalized when the encoder says).

    Packed: each text goes to the narrowest of packs.batching.PACK_WIDTHS (up to
    max_length) that holds it,
    and each width is packed on its own. Attention over a packed row costs its width per
    token (SDPA with the block-diagonal mask), so short texts packed into 256-token rows
    would pay for 256 where a length-sorted batch pays for its own length; but a width
    whose texts do not fill its rows is merged into a wider one (`width_groups`)."""
    n = len(token_ids)
    if n == 0:
        return np.zeros((0, encoder.dimension), dtype=np.float32)
    lengths = np.array([len(t) for t in token_ids])
    longest = max(encoder.max_length, int(lengths.max()))
    if options.batching == "packed":
        parts = width_groups(
            lengths,
            longest,
            options.max_sequences_per_pack,
            options.algorithm,
            encoder.model.config.hidden_size,
        )
    else:
        parts = [(np.arange(n), longest)]
    runner = runner_of(encoder, options.device, options.dtype, options.compile, options.runtime)
    if runner.needs_calibration:
        calibrate(runner, encoder, token_ids, options)
    vectors = np.empty((n, encoder.dimension), dtype=np.float32)
    for members, width in parts:
        if len(members):
            vectors[members] = _embed_part(
                encoder, [token_ids[i] for i in members], lengths[members], width, options
            )
    encoder.stats["texts"] += n
    encoder.stats["tokens"] += int(lengths.sum())
    return l2_normalize(vectors) if encoder.normalize else vectors


def part_batcher(encoder: LoadedModel, lengths: np.ndarray, width: int, options: InferenceOptions) -> Batcher:
    """The batching of texts of at most `width` tokens (one of width_groups' parts)."""
    spec = BatchingSpec(
        EMBED_BATCHING[options.batching], options.batch_size, encoder.max_length, options.max_sequences_per_pack,
        options.algorithm, pack_length=width,
    )  # fmt: skip
    return Batcher(lengths, spec, seed=0)


def calibrate(runner, encoder: LoadedModel, token_ids: list, options: InferenceOptions) -> None:
    """OpenVINO int8's calibration: packed rows, batched as embedding batches them, of
    options.calibration_texts, else of a fixed sample of up to CALIBRATION_TEXTS of `token_ids`
    (the first chunk embedded: texts like the ones to come)."""
    from packed_transformers.inference.openvino_graphs import calibration_picks

    if options.calibration_texts:
        places = [f"calibration_texts[{i}]" for i in range(len(options.calibration_texts))]
        sample, _ = encoder.tokenize_texts(list(options.calibration_texts), places)
    else:
        sample = [token_ids[i] for i in calibration_picks(len(token_ids))]
    lengths = np.array([len(t) for t in sample])
    longest = max(encoder.max_length, int(lengths.max()))
    hidden = encoder.model.config.hidden_size
    rows = []  # every width group's rows: one calibration over texts of every length
    for members, width in width_groups(
        lengths, longest, options.max_sequences_per_pack, options.algorithm, hidden
    ):
        if len(members):
            batcher = part_batcher(encoder, lengths[members], width, options)
            rows += runner.calibration_rows([sample[i] for i in members], batcher.epoch(0, shuffle=False),
                                            batcher.width)  # fmt: skip
    runner.calibrate(rows)


def _embed_part(
    encoder: LoadedModel, token_ids: list, lengths: np.ndarray, width: int, options: InferenceOptions
):
    """One batching pass over texts of at most `width` tokens -> [n, D] in their order."""
    batcher = part_batcher(encoder, lengths, width, options)
    tables = batcher.epoch(0, shuffle=False)
    slots, index = [], []
    for per_slot, example_index in run_tables(encoder, token_ids, tables, batcher.width, options):
        slots.append(per_slot.reshape(-1, per_slot.shape[-1]))
        index.append(example_index.reshape(-1))
    encoder.stats["slots"] += sum(len(t) * batcher.width(t) for t in tables)
    return unpack_outputs(np.concatenate(slots)[:, None], np.concatenate(index)[:, None], len(token_ids))


def l2_normalize(vectors: np.ndarray) -> np.ndarray:
    """Rows divided by their L2 norm (torch's F.normalize: a zero row stays zero)."""
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)


# chunk_seconds: the first chunk's texts (no rate measured yet), and the fewest a chunk holds (a batch)
FIRST_CHUNK_TEXTS = 256
FEWEST_CHUNK_TEXTS = 32


@dataclass
class ChunkSizes:
    """Texts per chunk: `most` each, or with `seconds` what about `seconds` of the model's work
    holds at the last chunk's rate (FIRST_CHUNK_TEXTS first, never above `most`). A writer keeps
    rows chunk by chunk: Ctrl-C then keeps all but the last seconds' work, at any input size."""

    most: int
    seconds: float | None = None
    texts_per_second: float | None = None  # the last chunk's rate through the model

    def next_size(self) -> int:
        if not self.seconds:
            return self.most
        if self.texts_per_second is None:
            return min(self.most, FIRST_CHUNK_TEXTS)
        return min(self.most, max(FEWEST_CHUNK_TEXTS, int(self.texts_per_second * self.seconds)))

    def observe(self, texts: int, seconds: float) -> None:
        self.texts_per_second = texts / max(seconds, 1e-6)


def iter_encode(
    texts: Iterable[str], encoder: LoadedModel, options: InferenceOptions, where=None
) -> Iterator[np.ndarray]:
    """Embeddings of `texts` chunk by chunk (ChunkSizes: options.chunk_texts texts each, or about
    options.chunk_seconds of work), in input order. `where(i)` names text i in errors (default
    "texts[i]").

    The next chunk is read and tokenized in a second thread while the model runs the current
    one (the tokenizer releases the GIL); a mistake in the next chunk is raised only after the
    current chunk's array is yielded, so a writer keeps every row before it (as it did
    unprefetched). The next chunk's size is the rate measured when its reading starts."""
    sizes = ChunkSizes(options.chunk_texts, options.chunk_seconds)
    chunks = iter(_text_chunks(texts, sizes.next_size))
    with ThreadPoolExecutor(1, thread_name_prefix="tokenize") as pool:

        def tokenize_next() -> list | None:  # None: the input is done
            start, chunk = next(chunks, (None, None))
            return None if chunk is None else _tokenize_chunk(chunk, start, encoder, options, where)

        pending = pool.submit(tokenize_next)
        while (token_ids := pending.result()) is not None:
            pending = pool.submit(tokenize_next)
            started = time.perf_counter()
            vectors = embed_token_ids(encoder, token_ids, options)
            sizes.observe(len(token_ids), time.perf_counter() - started)
            yield vectors


def _text_chunks(texts: Iterable[str], size_of: Callable[[], int]) -> Iterator[tuple[int, list[str]]]:
    """(index of the first text, up to size_of() texts, asked as each chunk starts) in input order."""
    chunk: list[str] = []
    start, size = 0, size_of()
    for text in texts:
        chunk.append(text)
        if len(chunk) >= size:
            yield start, chunk
            start += len(chunk)
            chunk, size = [], size_of()
    if chunk:
        yield start, chunk


def _tokenize_chunk(chunk, start, encoder, options, where) -> list:
    """A chunk's texts (the prompt put first) -> token id arrays; ExampleError names the text."""
    places = [where(start + i) if where else f"texts[{start + i}]" for i in range(len(chunk))]
    for text, place in zip(chunk, places):
        if not isinstance(text, str):
            raise ExampleError(f"{place}: expected a string, got {type(text).__name__}")
    prompt = encoder.prompt(options.prompt_name)
    token_ids, truncated = encoder.tokenize_texts(
        [prompt + text for text in chunk] if prompt else chunk, places
    )
    encoder.stats["truncated"] += truncated
    return token_ids


def encode(
    texts: list[str], encoder: LoadedModel, options: InferenceOptions | None = None, **overrides
) -> np.ndarray:
    """Texts -> float32 [n, D], row i for texts[i]."""
    options = replace(options or InferenceOptions.for_embedding(), **overrides)
    if options.batching not in EMBED_BATCHING:
        raise ValueError(f"batching must be one of {tuple(EMBED_BATCHING)}, got {options.batching!r}")
    chunks = list(iter_encode(texts, encoder, options))
    return np.concatenate(chunks) if chunks else np.zeros((0, encoder.dimension), dtype=np.float32)
