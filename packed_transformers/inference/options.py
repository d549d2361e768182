"""How a run batches and computes: one `InferenceOptions` value for every kind of inference
(classification, QA and token tasks, embeddings; the commands, the Ray actors, the Python
API, sent to Ray's actors as `dataclasses.asdict(options)`), read from a command's options
by name (`from_args`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from packed_transformers.packs.batching import Batcher, BatchingSpec

# Texts per batch where nothing says otherwise: predict's, and sentence-transformers' encode's.
PREDICT_BATCH_SIZE = 64
EMBEDDING_BATCH_SIZE = 32


@dataclass(frozen=True)
class InferenceOptions:
    """batching: packs.batching.BATCHING_MODES (embeddings: common.choices.EMBED_BATCHING);
    batch_size: examples per batch (packed: per batch of packs, rows = batch_size / packing
    factor); max_sequences_per_pack: K (None: chosen from the lengths,
    packs.tokenized.fitting_depth); pack_length: tokens per pack, None = the folder's (or,
    where it names none, packs grouped by row width); device; dtype: float32 | bfloat16 | int8
    (autocast); chunk_texts: texts embedded per chunk (memory bounded by a chunk); chunk_seconds:
    None (every chunk chunk_texts), or chunks sized to about this many seconds of the model's
    work at the rate measured so far, at most chunk_texts (inference.embedding.ChunkSizes: the
    embed command's, so that Ctrl-C keeps all but the last seconds and its bar moves);
    prompt_name: an embedding model's prompt (None: its default prompt, if any); runtime:
    torch, openvino (float32 or int8, one graph compiled for every row shape), or auto (the one measured
    faster on this CPU's kind: inference.runtime_choice)."""

    batching: str = "packed"
    batch_size: int = PREDICT_BATCH_SIZE
    max_sequences_per_pack: int | None = None
    algorithm: str = "lpfhp"
    pack_length: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    chunk_texts: int = 8192
    chunk_seconds: float | None = None
    prompt_name: str | None = None
    # torch.compile the forward once per row width (inference.torch_backend.compiled_forward)
    compile: bool = False
    runtime: str = "torch"  # "openvino": one compiled graph (inference.openvino_graphs); "auto"
    # openvino int8's calibration texts (None: a sample of the first texts embedded)
    calibration_texts: tuple[str, ...] | None = None

    @classmethod
    def from_args(cls, args) -> InferenceOptions:
        """A command's parsed options (argparse names equal the field names; a field the
        command has no option for keeps its default)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    @classmethod
    def for_embedding(cls, **settings) -> InferenceOptions:
        """Embedding's defaults (EMBEDDING_BATCH_SIZE texts per batch), `settings` over them."""
        return cls(**{"batch_size": EMBEDDING_BATCH_SIZE, **settings})

    def batcher(self, lengths, width: int, default_pack_length: int) -> Batcher:
        """The batching over examples of `lengths`, rows `width` tokens wide; packs of
        pack_length tokens, else `default_pack_length`."""
        spec = BatchingSpec(self.batching, self.batch_size, width, self.max_sequences_per_pack, self.algorithm,
                            pack_length=self.pack_length or default_pack_length)  # fmt: skip
        return Batcher(lengths, spec, seed=0)
