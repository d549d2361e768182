"""Packed inference on Ray Data: callable classes for `Dataset.map_batches`, one model per
actor, every batch packed inside its replica.

    import ray.data
    from packed_transformers.ray_jobs.actors import PackedEmbedder, PackedPredictor, embed_dataset

    ds = ray.data.read_parquet("s3://bucket/docs/")            # a "text" column
    ds = ds.map_batches(PackedEmbedder, fn_constructor_kwargs={"model": "models/minilm"},
                        batch_size=4096, compute=ray.data.ActorPoolStrategy(size=8),
                        batch_format="pyarrow")
    ds.write_parquet("out/")                                   # + an "embedding" column
    # or, the same in one call:
    ds = embed_dataset(ds, "models/minilm", concurrency=8)

A batch (pyarrow Table, pandas DataFrame or dict of numpy arrays, as Ray hands it) goes
out as the same kind with columns added: `embedding` (list of float32, D per row) from
PackedEmbedder; `label` (multi-label: `labels`) and `scores` (list of float64) from
PackedPredictor (scores: predict's, rounded to 6 decimals). The numbers are the single-process commands' (commands.embed,
commands.predict): the same loaders, the same packed runner. Larger batches pack better
(more lengths to fit together): 1,000-10,000 texts per batch is a good range.

The whole-file jobs with exactly-once output (`--ray` on the commands) are
ray_jobs/job.py's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from packed_transformers.data.classification_data import ExampleError, Examples
from packed_transformers.data.text_rule import check_text


def texts_of(batch, column: str) -> list:
    """A column of a Ray batch (pyarrow Table, pandas DataFrame or dict of arrays) as a list."""
    if hasattr(batch, "column_names") and hasattr(batch, "column"):  # pyarrow.Table
        if column not in batch.column_names:
            raise ExampleError(
                f"the batch has no column '{column}'; its columns: {', '.join(batch.column_names)}"
            )
        return batch.column(column).to_pylist()
    if column not in batch:
        raise ExampleError(f"the batch has no column '{column}'; its columns: {', '.join(map(str, batch))}")
    values = batch[column]
    return values.tolist() if hasattr(values, "tolist") else list(values)


def with_columns(batch, columns: dict):
    """`batch` with `columns` ({name: list per row, or float32 [n, D]}) added, of its own kind."""
    if hasattr(batch, "append_column"):  # pyarrow.Table
        import pyarrow as pa

        for name, values in columns.items():
            if isinstance(values, np.ndarray) and values.ndim == 2:  # a list of float32 per row
                flat = pa.array(np.ascontiguousarray(values, dtype=np.float32).ravel())
                array = pa.ListArray.from_arrays(
                    np.arange(0, values.size + 1, values.shape[1], dtype=np.int32), flat
                )
            else:
                array = pa.array(values)
            batch = batch.append_column(name, array)
        return batch
    if hasattr(batch, "assign"):  # pandas.DataFrame
        return batch.assign(**{name: list(values) for name, values in columns.items()})
    out = dict(batch)
    for name, values in columns.items():
        out[name] = values if isinstance(values, np.ndarray) else np.array(values, dtype=object)
    return out


def checked_texts(texts: list, column: str, where, empty_ok: bool = False, none_ok: bool = False) -> list:
    """The single-process commands' rules for any batch (Parquet and user batches never
    went through their JSON-lines reader): a string (empty_ok: "" allowed, as predict
    allows it and embed does not; none_ok: None allowed, for pairs), valid Unicode, at most
    MAX_FIELD_CHARS characters; else one line naming the row."""
    for i, text in enumerate(texts):
        check_text(text, f"{where(i)}: column '{column}'", empty_ok=empty_ok, none_ok=none_ok)
    return texts


class PackedEmbedder:
    """A sentence-transformers (or BERT / family encoder) folder as a `map_batches` callable:
    texts -> `embedding` (float32, normalized when the folder says), packed.

    model: the folder (every node must see it); text_column: the texts; the other options
    are commands.embed's (pooling, normalize, max_length, prompt_name, batching, K...)."""

    def __init__(
        self, model, text_column: str = "text", output_column: str = "embedding", pooling=None,
        normalize=None, max_length=None, prompt_name=None, batching: str = "packed", batch_size: int = 32,
        max_sequences_per_pack: int | None = None, algorithm: str = "lpfhp", dtype: str = "float32", threads: int | None = None,
        compile: bool = False,
    ):  # fmt: skip
        import torch

        from packed_transformers.door.opener import ForEmbedding, open_folder
        from packed_transformers.inference.options import InferenceOptions

        if threads:
            torch.set_num_threads(threads)
        self.encoder = open_folder(
            Path(model), ForEmbedding(pooling, normalize=normalize, max_length=max_length)
        )
        self.encoder.prompt(prompt_name)  # an unknown prompt name: refused at construction
        self.text_column, self.output_column = text_column, output_column
        self.options = InferenceOptions(
            batching,
            batch_size,
            max_sequences_per_pack,
            algorithm,
            device="cpu",
            dtype=dtype,
            prompt_name=prompt_name,
            compile=compile,
        )

    @property
    def dimension(self) -> int:
        return self.encoder.dimension

    def embed(self, texts: list[str], where=lambda i: f"row {i}") -> np.ndarray:
        """Texts -> float32 [n, D] in order."""
        from packed_transformers.inference.embedding import iter_encode

        checked_texts(texts, self.text_column, where)
        chunks = list(iter_encode(texts, self.encoder, self.options, where))
        return np.concatenate(chunks).astype(np.float32, copy=False)

    def __call__(self, batch):
        return with_columns(batch, {self.output_column: self.embed(texts_of(batch, self.text_column))})


class PackedPredictor:
    """A classification folder (finetune.train's, or any transformers sequence classifier)
    as a `map_batches` callable: texts (and pairs) -> `label` / `labels` and `scores`.

    model: the folder; text_column / pair_column: the inputs (default: the fields the
    folder was trained with); the other options are commands.predict's."""

    def __init__(
        self, model, text_column: str | None = None, pair_column: str | None = None, batching: str = "packed",
        batch_size: int = 64, max_sequences_per_pack: int | None = None, algorithm: str = "lpfhp", pack_length=None,
        dtype: str = "float32", threads: int | None = None, compile: bool = False,
    ):  # fmt: skip
        import torch

        from packed_transformers.door.opener import open_folder
        from packed_transformers.inference.options import InferenceOptions
        from packed_transformers.inference.runner import Runner

        if threads:
            torch.set_num_threads(threads)
        self.folder = open_folder(Path(model))
        spec = self.folder.spec
        if spec.task != "classification":
            raise ExampleError(
                f"{model}: a {spec.task} folder; Ray inference runs sequence classification (predict and "
                "the server run this folder)"
            )
        self.text_column = text_column or spec.fields.text
        self.pair_column = pair_column if pair_column is not None else spec.fields.pair
        self.label_names, self.multi_label = list(spec.labels), spec.multi_label
        self.runner = Runner(self.folder.model, "cpu", dtype, compiled=compile)
        self.options = InferenceOptions(
            batching, batch_size, max_sequences_per_pack, algorithm, pack_length, dtype=dtype
        )

    def logits(self, texts: list[str], pairs: list | None = None, where=lambda i: f"row {i}") -> np.ndarray:
        """Texts (and pairs) -> logits float32 [n, C] in order."""
        from packed_transformers.inference.classify import classify_examples

        checked_texts(texts, self.text_column, where, empty_ok=True)  # commands.predict's rule
        if pairs is not None:
            checked_texts(pairs, self.pair_column, where, empty_ok=True, none_ok=True)
        pairs = pairs if pairs is not None else [None] * len(texts)
        examples = Examples(
            list(texts), list(pairs), [None] * len(texts), [where(i) for i in range(len(texts))]
        )
        logits, _, _ = classify_examples(
            self.folder, self.runner, examples, np.zeros(len(texts), dtype=np.int64), self.options
        )  # fmt: skip
        return logits

    def records(
        self, texts: list[str], pairs=None, where=lambda i: f"row {i}", first_index: int = 0
    ) -> list[dict]:
        """Texts -> commands.predict's output records ({"index", "label" | "labels", "scores"})."""
        from packed_transformers.inference.predictions import prediction_records

        return list(prediction_records(self.logits(texts, pairs, where), self.label_names, self.multi_label,
                                       first_index))  # fmt: skip

    def __call__(self, batch):
        texts = texts_of(batch, self.text_column)
        has_pair = self.pair_column and (
            self.pair_column in (batch.column_names if hasattr(batch, "column_names") else batch)
        )
        pairs = texts_of(batch, self.pair_column) if has_pair else None
        records = self.records(texts, pairs)
        name = "labels" if self.multi_label else "label"
        return with_columns(
            batch, {name: [r[name] for r in records], "scores": [list(r["scores"].values()) for r in records]}
        )


def _actor_pool(actors: int):
    import ray.data

    return ray.data.ActorPoolStrategy(size=actors)


def embed_dataset(dataset, model, concurrency: int = 1, batch_size: int = 4096, **options):
    """A `ray.data.Dataset` with a text column -> the Dataset with an `embedding` column
    (lazy, as Ray's map_batches: nothing runs until it is consumed or written).
    options: PackedEmbedder's; concurrency: actors (one model each)."""
    return dataset.map_batches(
        PackedEmbedder, fn_constructor_kwargs={"model": str(model), **options}, batch_size=batch_size,
        compute=_actor_pool(concurrency), batch_format="pyarrow",
    )  # fmt: skip


def predict_dataset(dataset, model, concurrency: int = 1, batch_size: int = 4096, **options):
    """A `ray.data.Dataset` with a text (and pair) column -> the Dataset with `label`
    (multi-label: `labels`) and `scores` columns (lazy). options: PackedPredictor's."""
    return dataset.map_batches(
        PackedPredictor, fn_constructor_kwargs={"model": str(model), **options}, batch_size=batch_size,
        compute=_actor_pool(concurrency), batch_format="pyarrow",
    )  # fmt: skip
