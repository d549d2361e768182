"""What every packed model's forward returns: `PackedOutput`, a dict that also answers its
keys as attributes and integer indices, as transformers' `ModelOutput` does
(`model(**batch).loss`, `out["logits"]`, `out[0]`). A plain dict stays what Trainer, the
runner and torch.compile see: PackedOutput is a dict subclass, nothing more.

Names transformers' heads declare (loss, logits, ...) read None when absent, as a
`ModelOutput` field left unset does (`model(**rows).loss` is None without labels); any other
missing name is an AttributeError. Imports nothing.
"""

from __future__ import annotations

# Fields of transformers' task outputs (SequenceClassifierOutput, QuestionAnsweringModelOutput,
# TokenClassifierOutput, CausalLMOutput, BaseModelOutput): None when a forward did not set them.
DECLARED = frozenset(
    {"loss", "logits", "start_logits", "end_logits", "hidden_states", "attentions", "last_hidden_state",
     "past_key_values", "embeddings"}
)  # fmt: skip


class PackedOutput(dict):
    """A packed model's outputs: key, attribute and index access (index: the values in key
    order, None-valued keys skipped, as ModelOutput.to_tuple)."""

    __slots__ = ()

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            if name in DECLARED:
                return None
            raise AttributeError(
                f"{type(self).__name__} has no output {name!r}; it has {sorted(self)}"
            ) from None

    def __getitem__(self, key):
        if isinstance(key, int | slice):
            return self.to_tuple()[key]
        return dict.__getitem__(self, key)

    def to_tuple(self) -> tuple:
        return tuple(value for value in self.values() if value is not None)
