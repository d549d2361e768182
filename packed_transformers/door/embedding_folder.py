"""Opening an embedding model: a sentence-transformers folder (its modules.json decides
pooling, Normalize, max_seq_length and lower-casing), any encoder or decoder folder with a
pooling given, or a SentenceTransformer already in memory (its weights shared, no file read).
Each gives the one LoadedModel every inference path runs (door.loaded)."""

from __future__ import annotations

from dataclasses import replace

from packed_transformers.common.choices import INFERENCE_ATTENTION_BACKEND, check_pooling
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.door.folder import check_vocabulary_fits, open_packed_model, open_tokenizer
from packed_transformers.door.folder_spec import EmbeddingSpec, embedding_spec
from packed_transformers.door.loaded import LoadedModel
from packed_transformers.door.st_folder import describe_embedding_folder
from packed_transformers.model.opening import ModelOptions, packed_from_loaded


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
    # SDPA unless asked otherwise: a sentence-transformers folder names no backend, and SDPA
    # measured fastest here for every batching mode (docs/embeddings.md)
    options = ModelOptions(  # pooling has no weights: no head is needed from the file
        new_head=True,
        attention_backend=attention_backend or INFERENCE_ATTENTION_BACKEND,
        pooling=spec.embedding.pooling,
    )
    opened = open_packed_model(folder, "embedding", options, spec.model_config or None)
    model, positions = opened.model, opened.max_tokens
    tokenizer = open_tokenizer(folder, spec.model_config or None).tokenizer  # as AutoTokenizer builds it
    check_vocabulary_fits(folder, tokenizer, model)
    length = max_length or min(spec.max_sequence_length or positions, positions)
    if not 3 <= length <= positions:
        raise ExampleError(f"max length {length}: the model takes 3 to {positions} tokens per text")
    embedding = spec.embedding if normalize is None else replace(spec.embedding, normalize=normalize)
    spec = replace(spec, max_sequence_length=length, embedding=embedding)
    return LoadedModel(spec, model.to(device).eval(), tokenizer, max_input_length=length)


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
    return LoadedModel(
        spec, model, _backend_tokenizer(transformer.tokenizer), max_input_length=int(st_model.max_seq_length)
    )


def _backend_tokenizer(hf_tokenizer):
    tokenizer = hf_tokenizer.backend_tokenizer
    copy = type(tokenizer).from_str(tokenizer.to_str())  # truncation/padding settings are per object
    copy.no_truncation()
    copy.no_padding()
    return copy
