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

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from common.choices import EMBED_BATCHING
from data.classification_data import ExampleError, check_unicode, encode_within
from finetune.batching import Batcher, BatchingSpec, width_groups
from finetune.folder import check_config_values, check_vocabulary_fits, check_weights_file
from finetune.rows import unpack_outputs
from finetune.runner import Runner
from model.embedding import check_pooling
from model.families import UnsupportedFamily
from model.opening import ModelOptions, open_model, packed_from_loaded

# sentence-transformers' legacy pooling flags, in the order its Pooling concatenates them
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


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


@dataclass
class Encoder:
    """A loaded embedding model and how texts reach it."""

    model: object  # a packed embedding model (model.opening): pools, never normalizes; `normalize` is applied after
    tokenizer: object  # a `tokenizers` Tokenizer; truncation off (done here)
    max_length: int  # tokens per text, [CLS] and [SEP] included (max_seq_length)
    normalize: bool  # L2-normalize (sentence-transformers' Normalize module)
    lowercase: bool = False  # sentence-transformers' do_lower_case: lower-case before tokenizing
    name: str = ""
    prompts: dict = field(default_factory=dict)  # name -> text put before each text (sentence-transformers')
    default_prompt_name: str | None = None
    stats: dict = field(default_factory=lambda: {"texts": 0, "tokens": 0, "slots": 0, "truncated": 0})
    _runners: dict = field(default_factory=dict, repr=False)  # (device, dtype) -> Runner
    _cutters: dict = field(default_factory=dict, repr=False)  # direction -> truncating tokenizer

    @property
    def dimension(self) -> int:
        return self.model.dimension

    def prompt(self, name: str | None) -> str:
        """The text put before every text, as sentence-transformers' encode(prompt_name=)
        does: the named prompt, or with no name the model's default one ("" if none)."""
        name = self.default_prompt_name if name is None else name
        if name is None:
            return ""
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none"
            raise ExampleError(f"prompt name {name!r}: this model's prompts are {known}")
        return self.prompts[name]

    def runner(self, device: str, dtype: str) -> Runner:
        """The model's finetune.runner.Runner on `device` in `dtype` (built, and so checked,
        once per pair)."""
        key = (str(device), dtype)
        if key not in self._runners:
            self._runners[key] = Runner(self.model, device, dtype)
        return self._runners[key]

    def tokenize(self, texts: list[str], where: list[str], truncate: bool = True, direction: str = "right"):
        """-> (token id arrays int64, truncated count): the tokenizer's own template
        (BERT's [CLS] ... [SEP], RoBERTa's <s> ... </s>, ...), cut to max_length as
        sentence-transformers cuts. Too long with truncate=False raises ExampleError naming
        the text; direction "left" keeps a text's end (TEI's option)."""
        for text, place in zip(texts, where):
            check_unicode(text, place)
        inputs = [t.lower() for t in texts] if self.lowercase else texts
        encoded, long = encode_within(
            self.tokenizer, inputs, self.max_length, truncate, direction, self._cutters
        )
        if long and not truncate:
            i = long[0]
            raise ExampleError(
                f"{where[i]}: {len(encoded[i].ids)} tokens; the model takes at most {self.max_length}"
            )
        return [np.asarray(e.ids, dtype=np.int64) for e in encoded], len(long)


def read_sentence_transformers(folder: Path) -> dict | None:
    """What a sentence-transformers folder says about encoding: {pooling, normalize,
    max_length, lowercase}; None for a folder without modules.json. ExampleError (one line,
    naming the file and key) when it is malformed or holds modules packing cannot run."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExampleError(f"{modules_file}: not valid JSON ({err})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise ExampleError(f"{modules_file}: expected a list of objects with a 'type'")
    kinds = [str(m["type"]).rsplit(".", 1)[-1] for m in modules]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Normalize" for k in kinds[2:]):
        raise ExampleError(
            f"{modules_file}: modules {kinds}; packed encoding runs Transformer -> Pooling (-> Normalize)"
        )
    pooling_config = _json_file(folder / modules[1].get("path", "") / "config.json")
    if "pooling_mode" in pooling_config:
        modes = pooling_config["pooling_mode"]
    else:
        modes = [mode for key, mode in LEGACY_POOLING_KEYS.items() if pooling_config.get(key)] or ["mean"]
    if pooling_config.get("include_prompt", True) is not True:
        raise ExampleError(
            f"{folder / modules[1].get('path', '')}/config.json: include_prompt false is not supported"
        )
    try:
        modes = check_pooling(modes)
    except ValueError as err:
        raise ExampleError(f"{folder / modules[1].get('path', '')}/config.json: {err}") from None
    transformer_folder = folder / modules[0].get("path", "")
    transformer_config = _json_file(transformer_folder / "sentence_bert_config.json", {})
    # max_seq_length: sentence_bert_config.json (older folders), else the tokenizer's
    # model_max_length (where sentence-transformers 5+ saves it); capped by the positions later.
    max_length = transformer_config.get("max_seq_length")
    if max_length is None:
        max_length = _json_file(transformer_folder / "tokenizer_config.json", {}).get("model_max_length")
        max_length = max_length if isinstance(max_length, int) and 3 <= max_length < 1_000_000 else None
    if max_length is not None and (
        not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 3
    ):
        raise ExampleError(
            f"{transformer_folder}/sentence_bert_config.json: max_seq_length must be an integer >= 3, got {max_length!r}"
        )
    prompts, default_prompt = read_prompts(folder / "config_sentence_transformers.json")
    return {
        "pooling": modes,
        "normalize": "Normalize" in kinds,
        "max_length": max_length,
        "lowercase": bool(transformer_config.get("do_lower_case", False)),
        "prompts": prompts,
        "default_prompt_name": default_prompt,
    }


def read_prompts(path: Path) -> tuple[dict, str | None]:
    """config_sentence_transformers.json's `prompts` {name: text} and `default_prompt_name`
    (e5-, bge- and nomic-style models ship them); ExampleError naming the key if malformed."""
    described = _json_file(path, {})
    prompts = described.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()
    ):
        raise ExampleError(f"{path}: key 'prompts' must be an object of name -> prompt text")
    default = described.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ExampleError(
            f"{path}: key 'default_prompt_name' is {default!r}, not one of its prompts {sorted(prompts)}"
        )
    return prompts, default


def _json_file(path: Path, default=None) -> dict:
    if not path.is_file():
        if default is not None:
            return default
        raise ExampleError(f"{path}: not found (the folder's modules.json names it)")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExampleError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ExampleError(f"{path}: expected a JSON object")
    return value


def load_tokenizer_of(folder: Path):
    """The folder's fast tokenizer as transformers' AutoTokenizer (and so sentence-transformers)
    builds it: tokenizer.json, else what it converts from the folder's files (a vocab.txt with
    tokenizer_config.json's do_lower_case, cased or not)."""
    from finetune.folder import folder_tokenizer

    return folder_tokenizer(folder)


def load_encoder(
    folder,
    pooling=None,
    normalize: bool | None = None,
    max_length: int | None = None,
    device: str = "cpu",
    attention_backend: str | None = None,
) -> Encoder:
    """A sentence-transformers folder (its modules.json decides pooling, Normalize,
    max_seq_length and lower-casing; arguments given here override), or any BERT folder
    with `pooling` given (max_length then defaults to its position embeddings).
    ExampleError (one line) for a folder that cannot be read."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ExampleError(f"{folder}: no config.json; expected a sentence-transformers or BERT folder")
    described = read_sentence_transformers(folder)
    if described is None:
        if pooling is None:
            raise ExampleError(
                f"{folder}: no modules.json (not a sentence-transformers folder); give --pooling"
            )
        described = {"pooling": pooling, "normalize": False, "max_length": None, "lowercase": False}
    check_weights_file(folder)
    check_config_values(folder)
    # SDPA unless asked otherwise: a sentence-transformers folder names no backend, and SDPA
    # measured fastest here for every batching mode (docs/embeddings.md)
    options = ModelOptions(  # pooling has no weights: no head is needed from the file
        new_head=True, attention_backend=attention_backend or "sdpa", pooling=pooling or described["pooling"]
    )
    try:
        opened = open_model(folder, "embedding", options)
        model, positions = opened.model, opened.max_tokens
    except UnsupportedFamily as err:
        raise ExampleError(f"{folder / 'config.json'}: {err}") from None
    except (OSError, ValueError, RuntimeError) as err:
        if isinstance(err, ExampleError):
            raise
        raise ExampleError(
            f"{folder}: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        ) from None
    tokenizer = load_tokenizer_of(folder)
    check_vocabulary_fits(folder, tokenizer, model)
    length = max_length or min(described["max_length"] or positions, positions)
    if not 3 <= length <= positions:
        raise ExampleError(f"max length {length}: the model takes 3 to {positions} tokens per text")
    return Encoder(
        model=model.to(device).eval(),
        tokenizer=tokenizer,
        max_length=length,
        normalize=described["normalize"] if normalize is None else normalize,
        lowercase=described["lowercase"],
        name=folder.name,
        prompts=described.get("prompts", {}),
        default_prompt_name=described.get("default_prompt_name"),
    )


def encoder_from_sentence_transformer(st_model) -> Encoder:
    """An Encoder sharing the weights of a loaded `SentenceTransformer` (Transformer ->
    Pooling (-> Normalize), a BERT inside): no copy of the weights, no file read."""
    modules = list(st_model)
    kinds = [type(m).__name__ for m in modules]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Normalize" for k in kinds[2:]):
        raise ValueError(
            f"packed encoding runs Transformer -> Pooling (-> Normalize); this model has {kinds}"
        )
    transformer, pooling = modules[0], modules[1]
    encoder = transformer.auto_model
    # BERT on this project's embedding model (the weights loaded by name, no copy kept),
    # other families on their own modules with packed attention: model.opening decides.
    token_types = "token_type_ids" in getattr(transformer.tokenizer, "model_input_names", ())
    model = packed_from_loaded(encoder, check_pooling(pooling.pooling_mode), token_types)
    return Encoder(
        model=model,
        tokenizer=_backend_tokenizer(transformer.tokenizer),
        max_length=int(st_model.max_seq_length),
        normalize="Normalize" in kinds,
        lowercase=bool(getattr(transformer, "do_lower_case", False)),
        name=str(getattr(st_model, "model_card_data", None) and st_model.model_card_data.base_model or ""),
        prompts=dict(getattr(st_model, "prompts", None) or {}),
        default_prompt_name=getattr(st_model, "default_prompt_name", None),
    )


def _backend_tokenizer(hf_tokenizer):
    tokenizer = hf_tokenizer.backend_tokenizer
    copy = type(tokenizer).from_str(tokenizer.to_str())  # truncation/padding settings are per object
    copy.no_truncation()
    copy.no_padding()
    return copy


def packed_encode(st_model, texts: list[str], **options) -> np.ndarray:
    """sentence-transformers' `model.encode(texts)` (numpy float32 [n, D]), packed: the same
    vectors, computed on packs. The Encoder is built once per model object and kept on it."""
    encoder = getattr(st_model, "_packed_encoder", None)
    if encoder is None:
        encoder = encoder_from_sentence_transformer(st_model)
        st_model._packed_encoder = encoder
    device = str(next(encoder.model.parameters()).device.type)
    return encode(texts, encoder, EncodeOptions(device=device, **options))


def run_tables(
    encoder: Encoder, token_ids: list, tables: Iterable[np.ndarray], width_of, options: EncodeOptions
):
    """Forward every batch table; -> (per-slot embeddings [rows, K, D], example_index [rows, K])
    per batch. The model pools; normalization is the caller's."""
    runner = encoder.runner(options.device, options.dtype)
    for batch in runner.run(token_ids, tables, width_of, None, ("embeddings",)):
        yield batch.outputs["embeddings"], batch.rows["example_index"]


def embed_token_ids(encoder: Encoder, token_ids: list, options: EncodeOptions) -> np.ndarray:
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


def _embed_part(encoder: Encoder, token_ids: list, lengths: np.ndarray, width: int, options: EncodeOptions):
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
    texts: Iterable[str], encoder: Encoder, options: EncodeOptions, where=None
) -> Iterator[np.ndarray]:
    """Embeddings of `texts` chunk by chunk (options.chunk_texts texts each), in input order.
    `where(i)` names text i in errors (default "texts[i]")."""
    chunk: list[str] = []
    start = 0
    for text in texts:
        chunk.append(text)
        if len(chunk) == options.chunk_texts:
            yield _encode_chunk(chunk, start, encoder, options, where)
            start += len(chunk)
            chunk = []
    if chunk:
        yield _encode_chunk(chunk, start, encoder, options, where)


def _encode_chunk(chunk, start, encoder, options, where) -> np.ndarray:
    places = [where(start + i) if where else f"texts[{start + i}]" for i in range(len(chunk))]
    for text, place in zip(chunk, places):
        if not isinstance(text, str):
            raise ExampleError(f"{place}: expected a string, got {type(text).__name__}")
    prompt = encoder.prompt(options.prompt_name)
    token_ids, truncated = encoder.tokenize([prompt + text for text in chunk] if prompt else chunk, places)
    encoder.stats["truncated"] += truncated
    return embed_token_ids(encoder, token_ids, options)


def encode(
    texts: list[str], encoder: Encoder, options: EncodeOptions | None = None, **overrides
) -> np.ndarray:
    """Texts -> float32 [n, D], row i for texts[i]."""
    options = replace(options or EncodeOptions(), **overrides)
    if options.batching not in EMBED_BATCHING:
        raise ValueError(f"batching must be one of {tuple(EMBED_BATCHING)}, got {options.batching!r}")
    chunks = list(iter_encode(texts, encoder, options))
    return np.concatenate(chunks) if chunks else np.zeros((0, encoder.dimension), dtype=np.float32)
