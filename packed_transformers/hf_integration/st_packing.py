"""Packing inside sentence-transformers: a loaded `SentenceTransformer` (or `CrossEncoder`) whose
transformer runs on packed rows, for its own trainer, its losses and its samplers, and for its
`encode` (`predict`).

    from packed_transformers.hf_integration.st_packing import pack_sentence_transformer
    model = SentenceTransformer(folder)
    packing = pack_sentence_transformer(model)          # nothing else in the script changes
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=pairs,
                                         loss=losses.MultipleNegativesRankingLoss(model))
    trainer.train()
    packing.padding                                     # the fractions each layout would pad

    reranker = CrossEncoder(folder, num_labels=1)       # the same for a cross-encoder:
    pack_cross_encoder(reranker)                        # CrossEncoderTrainer, its losses, predict

How: a packed forward on the transformers model inside the first module (sentence-transformers'
`Transformer`), wrapping its own. Before the model runs, the padded batch it is handed (input_ids, attention_mask
[N, L], token_type_ids) is laid out as packed rows [R, W]: the texts of that one call, placed by
the histogram packer (packs.tokenized.pack_examples), each text's positions from 0, attention
confined to its own text (model.families.packed_attention). After it, every text's hidden
states are put back where the padded batch had them ([N, L, H], zeros at padding), so
sentence-transformers' Pooling, Normalize, every loss and the saved folder are its own,
unchanged. Which texts form a call (the batch, the negatives) is the caller's: packing changes
only where a text sits. tests/hf_integration/test_st_packing.py holds the loss and every
gradient equal to the padded computation, and runs the real trainer; test_ce_packing.py the
same for a CrossEncoder (its classifier's encoder packed, the pooler run again on the states
put back, the head its own).

What it never does: change a module's class, parameter names or files (the folder the trainer
saves loads in a plain sentence-transformers install), or pack a call it cannot lay out
exactly (positional arguments its forward cannot name, explicit position ids or embeddings, an
empty text: those run padded).
Families whose encoder computes relative positions itself (DeBERTa-v2, MPNet) are refused in
one line: `packed train` with `data.task: embedding` packs them.

Uses model/ and packs/; imports sentence-transformers nowhere (it reads the modules it is given).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import numpy as np
import torch

from packed_transformers.model.families import family_of, use_packed_attention
from packed_transformers.packs.tokenized import pack_examples


@dataclass(frozen=True)
class TextLayout:
    """Where each real token of one padded batch [N, L] sits in packed rows [rows, width].

    source: int64 [T], each real token's flat index in the padded batch (N x L);
    target: int64 [T], the same token's flat index in the rows (rows x width);
    sequence_ids: int64 [rows, width], 1.. per text of a row (0: padding);
    positions: int64 [rows, width], each token's position inside its own text."""

    texts: int
    length: int
    rows: int
    width: int
    source: torch.Tensor
    target: torch.Tensor
    sequence_ids: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def plan(cls, attention_mask: torch.Tensor, algorithm: str = "lpfhp") -> TextLayout | None:
        """The layout of a padded batch (either padding side: a text's tokens are the mask's
        ones, in order), or None where a text is empty (no layout holds it)."""
        real = attention_mask.bool()
        texts, length = real.shape
        lengths = real.sum(1).cpu().numpy()
        if texts == 0 or (lengths == 0).any():
            return None
        table = pack_examples(lengths, length, None, algorithm, seed=0)  # [rows, K], -1: empty slot
        present = table >= 0
        sizes = np.where(present, lengths[np.maximum(table, 0)], 0)
        width = int(sizes.sum(1).max())
        first = np.arange(len(table))[:, None] * width + np.cumsum(sizes, 1) - sizes
        start, slot = np.empty(texts, np.int64), np.empty(texts, np.int64)
        start[table[present]] = first[present]
        slot[table[present]] = np.nonzero(present)[1] + 1
        device = attention_mask.device
        rank = real.long().cumsum(1) - 1  # [N, L]: each token's position inside its text
        source = real.reshape(-1).nonzero().squeeze(1)
        target = (torch.from_numpy(start).to(device)[:, None] + rank).reshape(-1)[source]
        cells = len(table) * width
        sequence_ids = torch.zeros(cells, dtype=torch.long, device=device)
        sequence_ids[target] = (
            torch.from_numpy(slot).to(device)[:, None].expand(texts, length).reshape(-1)[source]
        )
        positions = torch.zeros(cells, dtype=torch.long, device=device)
        positions[target] = rank.reshape(-1)[source]
        shape = (len(table), width)
        return cls(
            texts, length, len(table), width, source, target, sequence_ids.view(shape), positions.view(shape)
        )

    def pack(self, values: torch.Tensor, fill: int) -> torch.Tensor:
        """[N, L] per-token values -> [rows, width] (fill at padding)."""
        out = values.new_full((self.rows * self.width,), fill)
        out[self.target] = values.reshape(-1)[self.source]
        return out.view(self.rows, self.width)

    def unpack(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, width, H] -> [N, L, H], each text's states where the padded batch had its
        tokens, zeros at its padding (what every pooling of sentence-transformers masks out).
        Differentiable: the gradient flows back to the packed rows."""
        width = hidden.shape[-1]
        tokens = hidden.reshape(-1, width).index_select(0, self.target)
        out = hidden.new_zeros(self.texts * self.length, width).index_copy(0, self.source, tokens)
        return out.view(self.texts, self.length, width)


@dataclass
class PaddingCount:
    """Tokens the packed calls held: the texts' own, the padded batches' cells and the rows'
    cells. padding: the fraction of cells each layout spends on padding."""

    text_tokens: int = 0
    padded_cells: int = 0
    packed_cells: int = 0

    def add(self, layout: TextLayout) -> None:
        self.text_tokens += len(layout.source)
        self.padded_cells += layout.texts * layout.length
        self.packed_cells += layout.rows * layout.width

    @property
    def padding(self) -> dict[str, float]:
        def fraction(cells: int) -> float:
            return 1.0 - self.text_tokens / cells if cells else 0.0

        return {"padded": fraction(self.padded_cells), "packed": fraction(self.packed_cells)}


def by_keyword(signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's positional arguments named by the forward's `signature` -> ((), keywords), or
    the call as it was where they cannot be named (it then runs padded)."""
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return args, kwargs
    named = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                return args, kwargs
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return (), named


# the keywords a packed call replaces; a call that brings its own positions is left padded
LAID_OUT = ("input_ids", "attention_mask", "token_type_ids")


class SentenceTransformerPacking:
    """The packed forward of one SentenceTransformer's transformers model; `remove()` puts its
    own forward back (the model then runs padded, through transformers' SDPA).

    sentence-transformers calls the model's `forward` method itself (no module call, so no
    hook would run): the packed forward is set on that model object, wrapping its own."""

    def __init__(self, st_model, algorithm: str = "lpfhp"):
        from packed_transformers.model.family_model import PackedFamilyModel

        modules = list(st_model)
        if not modules or type(modules[0]).__name__ != "Transformer":
            kinds = [type(m).__name__ for m in modules]
            raise ValueError(
                f"packing runs a SentenceTransformer whose first module is a Transformer; it has {kinds}"
            )
        transformer = modules[0]
        encoder = getattr(transformer, "model", None) or transformer.auto_model
        # a CrossEncoder's Transformer holds a *ForSequenceClassification: its encoder (base_model)
        # is packed, and its head reads the states put back per pair, as it reads padded ones
        if getattr(encoder, "base_model", encoder) is not encoder:
            encoder = encoder.base_model
        model_type = encoder.config.model_type
        if family_of(model_type).pair_mask is not None:
            raise ValueError(
                f"model_type {model_type!r} computes its relative positions inside its encoder: packing inside "
                "sentence-transformers does not run it; `packed train` with data.task: embedding does"
            )
        if "forward" in vars(encoder):
            raise ValueError(
                "this SentenceTransformer is packed already (pack_sentence_transformer was called)"
            )
        tokenizer = getattr(transformer, "tokenizer", None) or getattr(transformer, "processor", None)
        token_types = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
        use_packed_attention(encoder)
        # the family's keywords for packed rows (positions, token types, layout); it shares the
        # encoder's modules and is never called itself
        self._arguments = (
            PackedFamilyModel(encoder, "embedding").hand_token_types(token_types).packed_arguments
        )
        self._pad_id = int(encoder.config.pad_token_id or 0)
        self.algorithm = algorithm
        self.count = PaddingCount()
        self._encoder, padded_forward = encoder, encoder.forward

        signature = inspect.signature(padded_forward)

        @functools.wraps(padded_forward)  # its signature stays the one callers inspect
        def packed_forward(*args, **kwargs):
            if args:  # a classifier hands its encoder input_ids by position
                args, kwargs = by_keyword(signature, args, kwargs)
            laid_out = None if args else self._lay_out(kwargs)
            if laid_out is None:
                return padded_forward(*args, **kwargs)
            layout, packed = laid_out
            return self._put_back(layout, padded_forward(**packed))

        encoder.forward = packed_forward

    @property
    def padding(self) -> dict[str, float]:
        return self.count.padding

    def remove(self) -> None:
        vars(self._encoder).pop("forward", None)

    def _lay_out(self, kwargs: dict) -> tuple[TextLayout, dict] | None:
        """The packed call's keywords, or None where the call runs padded."""
        mask, ids = kwargs.get("attention_mask"), kwargs.get("input_ids")
        if (
            kwargs.get("position_ids") is not None  # a classifier hands its encoder position_ids=None
            or kwargs.get("inputs_embeds") is not None
            or mask is None
            or ids is None
            or mask.dim() != 2
            or mask.shape != ids.shape
        ):
            return None
        layout = TextLayout.plan(mask, self.algorithm)
        if layout is None:
            return None
        segments = kwargs.get("token_type_ids")
        segments = layout.pack(segments, 0) if segments is not None else torch.zeros_like(layout.sequence_ids)
        packed = {k: v for k, v in kwargs.items() if k not in LAID_OUT and k != "position_ids"}
        packed.update(
            self._arguments(layout.pack(ids, self._pad_id), segments, layout.positions, layout.sequence_ids)
        )
        self.count.add(layout)
        return layout, packed

    def _put_back(self, layout: TextLayout, output):
        """The encoder's output with every text's states where the padded batch had them; its
        pooler (BERT's: the first token, dense, tanh) run again on them where it has one (what
        a classifier's head reads), else left out: pooled over packed rows, never handed on."""
        pooler = getattr(self._encoder, "pooler", None)
        if isinstance(output, tuple):
            hidden = layout.unpack(output[0])
            rest = tuple(output[1:])
            if pooler is not None and rest:
                rest = (pooler(hidden),) + rest[1:]
            return (hidden,) + rest
        fields = dict(output)
        fields["last_hidden_state"] = layout.unpack(output["last_hidden_state"])
        fields.pop("pooler_output", None)
        if pooler is not None and output.get("pooler_output") is not None:
            fields["pooler_output"] = pooler(fields["last_hidden_state"])
        if fields.get("hidden_states") is not None:
            fields["hidden_states"] = tuple(layout.unpack(h) for h in fields["hidden_states"])
        return type(output)(**fields)


def pack_sentence_transformer(st_model, algorithm: str = "lpfhp") -> SentenceTransformerPacking:
    """Make `st_model` (a loaded SentenceTransformer, or a CrossEncoder: Transformer first) run its
    transformer on packed rows from now on, for training, encoding and predicting; returns the
    packing's handle (its `padding`, its `remove()`)."""
    return SentenceTransformerPacking(st_model, algorithm)


# a CrossEncoder (sentence-transformers 4+: a Transformer over a *ForSequenceClassification) packs
# the same way: each (query, passage) pair a text of the packed rows, the head on its own states
pack_cross_encoder = pack_sentence_transformer
