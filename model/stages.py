"""Pipeline stage split from `layers_per_stage` (no backend code here).

Stage 0 holds the embeddings, the last stage the heads (and the pooler), as in
Graphcore's BERT; encoder layers are split as listed, e.g. [3, 7, 7, 7] for 24 layers.
"""

from __future__ import annotations


def stage_layer_ranges(num_layers: int, layers_per_stage: list[int]) -> list[range]:
    """The encoder-layer indices of each stage; clear errors for invalid splits."""
    if not layers_per_stage:
        raise ValueError("layers_per_stage is empty: give the number of encoder layers per stage")
    if any((not isinstance(n, int)) or isinstance(n, bool) or n < 0 for n in layers_per_stage):
        raise ValueError(f"layers_per_stage must hold integers >= 0, got {layers_per_stage}")
    if sum(layers_per_stage) != num_layers:
        raise ValueError(
            f"layers_per_stage {layers_per_stage} sums to {sum(layers_per_stage)}, "
            f"but the model has {num_layers} encoder layers"
        )
    ranges, start = [], 0
    for count in layers_per_stage:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def nonempty_stage_ranges(num_layers: int, layers_per_stage) -> list[range]:
    """`stage_layer_ranges`, and every stage must hold a layer (an empty stage would idle
    its device and its process). The one check of `execution.layers_per_stage` for the
    torch pipeline and the IPU plan; ValueError with a message the caller prefixes."""
    ranges = stage_layer_ranges(num_layers, list(layers_per_stage))
    if any(len(r) == 0 for r in ranges):
        raise ValueError(f"{list(layers_per_stage)}: a stage without layers; every stage needs one")
    return ranges
