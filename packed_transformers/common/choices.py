"""The names an option chooses from, in one place. Standard library only: the commands'
parsers (commands/parsers.py) and door.folder_spec read them before torch is imported;
model/, finetune/ and the configs use the same tuples."""

from __future__ import annotations

# block-diagonal attention kernels of this project's packed BERT (model/attention.py)
ATTENTION_BACKENDS = ("dense", "sdpa", "flex", "varlen")
# the kernel inference runs where none is asked for (predict, embed, the server, Ray): every
# backend computes the same outputs, and SDPA with the block mask measured fastest on the CPU
# (docs/embeddings.md, "Where a whole run's time goes": predict's forward 1.5x the dense one)
INFERENCE_ATTENTION_BACKEND = "sdpa"
# sentence-embedding pooling, as sentence-transformers' Pooling names the modes
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")


def check_pooling(pooling) -> tuple[str, ...]:
    """A mode name or a sequence of them -> the tuple of modes (ValueError if unknown)."""
    modes = (pooling,) if isinstance(pooling, str) else tuple(pooling)
    unknown = [mode for mode in modes if mode not in POOLING_MODES]
    if not modes or unknown:
        raise ValueError(f"pooling must be one or more of {POOLING_MODES}, got {pooling!r}")
    return modes


# how examples form batches (packs/batching.py): fixed rows, per-batch longest, length-sorted, packed
BATCHING_MODES = ("padded", "dynamic", "uniform", "packed")
# the modes whose every batch has one width (packed: the pack length; padded: the maximum
# length): the others follow each batch's longest example, so a compiled step sees a new shape
FIXED_WIDTH_MODES = ("packed", "padded")
# commands.embed's --batching -> BATCHING_MODES (padded: rows of max_seq_length tokens; sorted:
# sentence-transformers' encode, batches of length-sorted texts padded to their longest)
EMBED_BATCHING = {"packed": "packed", "sorted": "uniform", "padded": "padded"}
# what runs the packed rows outside training (inference.runner): torch, OpenVINO (a graph per row
# shape, inference.openvino_graphs), ONNX Runtime (one graph, rows and width open,
# inference.onnx_graphs), or auto, the one measured faster on the CPU's kind
# (inference.runtime_choice, resolved before a Runner is built)
RUNTIMES = ("torch", "openvino", "onnxruntime", "auto")
# the runtimes that run an exported graph of the packed model (not torch's own forward)
GRAPH_RUNTIMES = ("openvino", "onnxruntime")
# the tasks whose packed rows a graph runtime runs and `packed export` writes: the pooled heads
# (a sequence's score or vector)
GRAPH_TASKS = ("classification", "embedding")
# FolderSpec.source of a folder `packed export` wrote (door.exported_folder): a graph, no torch
EXPORTED = "packed_export.json"
