"""Packed sentence embeddings: a sentence-transformers (or any BERT) folder, texts in, a
float32 [n, D] array out, row i for text i.

    encoder = load_encoder(folder)                       # reads modules.json, pooling, Normalize
    vectors = encode(["a text", "another"], encoder)     # numpy [2, D], packed batches
    vectors = packed_encode(st_model, texts)             # from a SentenceTransformer object

A text goes: tokenizer (the folder's tokenizer.json, else vocab.txt; truncated to
max_seq_length, as sentence-transformers does) -> token ids -> batch tables
(finetune.batching: packed, length-sorted or padded) -> rows (finetune.rows.pack_rows) ->
model.embedding.PackedBertForEmbedding (per-sequence pooling) -> back to input order.
Texts are encoded in chunks (`chunk_texts`), so memory is bounded by a chunk, never by the
input; `iter_encode` yields one chunk's array at a time for streaming writers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from common.choices import EMBED_BATCHING, INFERENCE_ATTENTION_BACKEND, check_pooling
from data.classification_data import ExampleError
from finetune.batching import Batcher, BatchingSpec, width_groups
from finetune.folder import check_config_values, check_vocabulary_fits, check_weights_file
from finetune.folder_spec import EmbeddingSpec, embedding_spec
from finetune.loaded import LoadedModel
from finetune.rows import unpack_outputs
from finetune.st_folder import describe_embedding_folder
from model.families import UnsupportedFamily
from model.opening import ModelOptions, NonFiniteWeights, open_model, packed_from_loaded


@dataclass
class EncodeOptions:
    """How texts are batched and run. batch_size: texts per batch (sentence-transformers'
    default 32; packed: rows = batch_size / packing factor); max_per_pack: K."""

    batching: str = "packed"
    batch_size: int = 32
    max_per_pack: int | None = None  # K; None: chosen from the lengths (packing.tokenized.fitting_depth)
    algorithm: str = "lpfhp"
    device: str = "cpu"
    dtype: str = "float32"
    chunk_texts: int = 8192
    prompt_name: str | None = None  # None: the model's default prompt (if it has one)


def load_tokenizer_of(folder: Path, config=None):
    """The folder's fast tokenizer as transformers' AutoTokenizer (and so sentence-transformers)
    builds it: tokenizer.json, else what it converts from the folder's files (a vocab.txt with
    tokenizer_config.json's do_lower_case, cased or not)."""
    from finetune.folder import open_tokenizer

    return open_tokenizer(folder, config).tokenizer


def load_encoder(
    folder,
    pooling=None,
    normalize: bool | None = None,
    max_length: int | None = None,
    device: str = "cpu",
    attention_backend: str | None = None,
) -> LoadedModel:
    """A sentence-transformers folder (its modules.json decides pooling, Normalize,
    max_seq_length and lower-casing; arguments given here override), or any encoder or
    decoder folder with `pooling` given (max_length then defaults to its positions).
    ExampleError (one line) for a folder that cannot be read."""
    spec = describe_embedding_folder(folder, pooling)
    folder = spec.path
    check_weights_file(folder)
    check_config_values(folder, spec.model_config)
    # SDPA unless asked otherwise: a sentence-transformers folder names no backend, and SDPA
    # measured fastest here for every batching mode (docs/embeddings.md)
    options = ModelOptions(  # pooling has no weights: no head is needed from the file
        new_head=True,
        attention_backend=attention_backend or INFERENCE_ATTENTION_BACKEND,
        pooling=spec.embedding.pooling,
    )
    try:
        opened = open_model(folder, "embedding", options, spec.model_config or None)
        model, positions = opened.model, opened.max_tokens
    except UnsupportedFamily as err:
        raise ExampleError(f"{folder / 'config.json'}: {err}") from None
    except (OSError, ValueError, RuntimeError) as err:
        if isinstance(err, ExampleError):
            raise
        if isinstance(err, NonFiniteWeights):  # names the weights file and the weight itself
            raise ExampleError(str(err)) from None
        raise ExampleError(
            f"{folder}: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        ) from None
    tokenizer = load_tokenizer_of(folder, spec.model_config or None)
    check_vocabulary_fits(folder, tokenizer, model)
    length = max_length or min(spec.max_sequence_length or positions, positions)
    if not 3 <= length <= positions:
        raise ExampleError(f"max length {length}: the model takes 3 to {positions} tokens per text")
    embedding = spec.embedding if normalize is None else replace(spec.embedding, normalize=normalize)
    spec = replace(spec, max_sequence_length=length, embedding=embedding)
    return LoadedModel(spec, model.to(device).eval(), tokenizer)


def encoder_from_sentence_transformer(st_model) -> LoadedModel:
    """A LoadedModel sharing the weights of a loaded `SentenceTransformer` (Transformer ->
    Pooling (-> Normalize)): no copy of the weights, no file read."""
    modules = list(st_model)
    kinds = [type(m).__name__ for m in modules]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Normalize" for k in kinds[2:]):
        raise ValueError(
            f"packed encoding runs Transformer -> Pooling (-> Normalize); this model has {kinds}"
        )
    transformer, pooling = modules[0], modules[1]
    # BERT on this project's embedding model (the weights loaded by name, no copy kept),
    # other families on their own modules with packed attention: model.opening decides.
    token_types = "token_type_ids" in getattr(transformer.tokenizer, "model_input_names", ())
    modes = check_pooling(pooling.pooling_mode)
    model = packed_from_loaded(transformer.auto_model, modes, token_types)
    embedding = EmbeddingSpec(
        pooling=modes,
        normalize="Normalize" in kinds,
        lowercase=bool(getattr(transformer, "do_lower_case", False)),
        prompts=dict(getattr(st_model, "prompts", None) or {}),
        default_prompt_name=getattr(st_model, "default_prompt_name", None),
    )
    name = str(getattr(st_model, "model_card_data", None) and st_model.model_card_data.base_model or "")
    spec = embedding_spec(None, embedding, int(st_model.max_seq_length), name, source="SentenceTransformer")
    return LoadedModel(spec, model, _backend_tokenizer(transformer.tokenizer))


def _backend_tokenizer(hf_tokenizer):
    tokenizer = hf_tokenizer.backend_tokenizer
    copy = type(tokenizer).from_str(tokenizer.to_str())  # truncation/padding settings are per object
    copy.no_truncation()
    copy.no_padding()
    return copy


def packed_encode(st_model, texts: list[str], **options) -> np.ndarray:
    """sentence-transformers' `model.encode(texts)` (numpy float32 [n, D]), packed: the same
    vectors, computed on packs. The LoadedModel is built once per model object and kept on it."""
    encoder = getattr(st_model, "_packed_encoder", None)
    if encoder is None:
        encoder = encoder_from_sentence_transformer(st_model)
        st_model._packed_encoder = encoder
    device = str(next(encoder.model.parameters()).device.type)
    return encode(texts, encoder, EncodeOptions(device=device, **options))


def run_tables(
    encoder: LoadedModel, token_ids: list, tables: Iterable[np.ndarray], width_of, options: EncodeOptions
):
    """Forward every batch table; -> (per-slot embeddings [rows, K, D], example_index [rows, K])
    per batch. The model pools; normalization is the caller's."""
    runner = encoder.runner(options.device, options.dtype)
    for batch in runner.run(token_ids, tables, width_of, None, ("embeddings",)):
        yield batch.outputs["embeddings"], batch.rows["example_index"]


def embed_token_ids(encoder: LoadedModel, token_ids: list, options: EncodeOptions) -> np.ndarray:
    """Token id arrays -> float32 [n, D] in input order (normalized when the encoder says).

    Packed: each text goes to the narrowest of finetune.batching.PACK_WIDTHS (up to
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
            lengths, longest, options.max_per_pack, options.algorithm, encoder.model.config.hidden_size
        )
    else:
        parts = [(np.arange(n), longest)]
    vectors = np.empty((n, encoder.dimension), dtype=np.float32)
    for members, width in parts:
        if len(members):
            vectors[members] = _embed_part(
                encoder, [token_ids[i] for i in members], lengths[members], width, options
            )
    encoder.stats["texts"] += n
    encoder.stats["tokens"] += int(lengths.sum())
    return l2_normalize(vectors) if encoder.normalize else vectors


def _embed_part(
    encoder: LoadedModel, token_ids: list, lengths: np.ndarray, width: int, options: EncodeOptions
):
    """One batching pass over texts of at most `width` tokens -> [n, D] in their order."""
    spec = BatchingSpec(
        EMBED_BATCHING[options.batching], options.batch_size, encoder.max_length, options.max_per_pack,
        options.algorithm, pack_length=width,
    )  # fmt: skip
    batcher = Batcher(lengths, spec, seed=0)
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


def iter_encode(
    texts: Iterable[str], encoder: LoadedModel, options: EncodeOptions, where=None
) -> Iterator[np.ndarray]:
    """Embeddings of `texts` chunk by chunk (options.chunk_texts texts each), in input order.
    `where(i)` names text i in errors (default "texts[i]").

    The next chunk is read and tokenized in a second thread while the model runs the current
    one (the tokenizer releases the GIL); a mistake in the next chunk is raised only after the
    current chunk's array is yielded, so a writer keeps every row before it (as it did
    unprefetched)."""
    chunks = iter(_text_chunks(texts, options.chunk_texts))
    with ThreadPoolExecutor(1, thread_name_prefix="tokenize") as pool:

        def tokenize_next() -> list | None:  # None: the input is done
            start, chunk = next(chunks, (None, None))
            return None if chunk is None else _tokenize_chunk(chunk, start, encoder, options, where)

        pending = pool.submit(tokenize_next)
        while (token_ids := pending.result()) is not None:
            pending = pool.submit(tokenize_next)
            yield embed_token_ids(encoder, token_ids, options)


def _text_chunks(texts: Iterable[str], size: int) -> Iterator[tuple[int, list[str]]]:
    """(index of the first text, up to `size` texts) in input order."""
    chunk: list[str] = []
    start = 0
    for text in texts:
        chunk.append(text)
        if len(chunk) == size:
            yield start, chunk
            start += len(chunk)
            chunk = []
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
    texts: list[str], encoder: LoadedModel, options: EncodeOptions | None = None, **overrides
) -> np.ndarray:
    """Texts -> float32 [n, D], row i for texts[i]."""
    options = replace(options or EncodeOptions(), **overrides)
    if options.batching not in EMBED_BATCHING:
        raise ValueError(f"batching must be one of {tuple(EMBED_BATCHING)}, got {options.batching!r}")
    chunks = list(iter_encode(texts, encoder, options))
    return np.concatenate(chunks) if chunks else np.zeros((0, encoder.dimension), dtype=np.float32)
