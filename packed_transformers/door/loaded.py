"""A model folder opened for running: the one result every loader gives (predict, embed, QA,
the token tasks, the server's engines, the Ray actors, `packed_encode`).

    loaded = open_folder(folder)                 # either kind, as the folder says (door.opener)
    loaded = load_finetuned(folder)              # a folder with a head (door.folder)
    loaded = load_encoder(folder)                # an embedding model (inference.embedding)
    loaded.spec                                  # what the folder says (door.folder_spec.FolderSpec)
    loaded.model                                 # the packed torch module (model.opening.open_model)
    loaded.tokenize(examples, labels, L, "truncate")   # labelled examples -> TokenizedExamples
    loaded.tokenize_texts(texts, where)          # texts -> token ids, cut as sentence-transformers cuts
    runner_of(loaded, device, dtype)             # inference.runner: its Runner, built once per pair
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from packed_transformers.data.classification_data import ExampleError, encode_within
from packed_transformers.data.text_rule import check_text
from packed_transformers.door.folder_spec import FolderSpec


def tokenize_examples(
    examples, labels, max_sequence_length: int, too_long: str, tokenizer, vocab, token_types
):
    """Labelled examples -> TokenizedExamples: BERT WordPiece over `vocab` where it is given
    (finetune.train's folders), else the tokenizer's own template; where the folder's
    tokenizer hands no token types, zeros (transformers feeds the model zeros then). The one
    rule for a folder being run (LoadedModel.tokenize) and a checkpoint fine-tuned
    (finetune.jobs.prepare_task)."""
    from packed_transformers.data.classification_data import tokenize, tokenize_by_template

    if vocab is not None:
        return tokenize(examples, tokenizer, vocab, labels, max_sequence_length, too_long)
    data = tokenize_by_template(examples, tokenizer, labels, max_sequence_length, too_long)
    if not token_types:
        data.segment_ids = [np.zeros_like(s) for s in data.segment_ids]
    return data


@dataclass
class LoadedModel:
    """spec: what the folder says about running it; model: the packed model (embedding
    models pool and never normalise: `normalize` is applied after); tokenizer: a `tokenizers`
    Tokenizer, truncation and padding off (the callers cut, and count what they cut): the
    folder's own (tokenizer.json) or, for finetune.train's WordPiece folders, the tokenizer of
    its vocab.txt, `vocab` then that vocabulary; token_types: whether the folder's tokenizer
    hands the model token_type_ids (where not, the model is given zeros, pairs included).
    stats: texts, tokens, slots and truncated counts of what embeddings ran."""

    spec: FolderSpec
    model: object
    tokenizer: object
    vocab: dict | None = None
    token_types: bool = True
    max_input_length: int = (
        0  # tokens per text a run takes (specials included); set by the door, read after it
    )
    stats: dict = field(default_factory=lambda: {"texts": 0, "tokens": 0, "slots": 0, "truncated": 0})
    # transformers' tokenizer as the door built it (QA windows need its overflow and offsets);
    # None for finetune.train's vocab.txt folders, whose WordPiece is built from `vocab`
    transformers_tokenizer: object = field(default=None, repr=False)
    _runners: dict = field(
        default_factory=dict, repr=False
    )  # (device, dtype) -> Runner (inference.runner.runner_of)
    _cutters: dict = field(default_factory=dict, repr=False)  # direction -> truncating tokenizer

    # -- what the spec says, by the names the inference code reads --------------------------
    @property
    def folder(self):
        return self.spec.path

    @property
    def max_length(self) -> int:
        """Tokens per text a run takes, the tokenizer's specials included: computed once by
        the door (the positions, the tokenizer's model_max_length, an embedding model's
        max_seq_length) and never after it."""
        return self.max_input_length

    @property
    def normalize(self) -> bool:
        return self.spec.embedding.normalize

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def dimension(self) -> int:
        return self.model.dimension

    # -- labelled examples (classification, QA) ---------------------------------------------
    def tokenize(self, examples, labels, max_sequence_length: int, too_long: str):
        """Examples -> TokenizedExamples, as this folder's tokenizer makes them."""
        return tokenize_examples(
            examples, labels, max_sequence_length, too_long, self.tokenizer, self.vocab, self.token_types
        )

    def hf_tokenizer(self):
        """transformers' fast tokenizer of the folder (QA windows need its overflow and offsets)."""
        if self.vocab is not None:
            from packed_transformers.data.qa_windows import fast_tokenizer

            return fast_tokenizer(self.vocab)
        if self.transformers_tokenizer is not None:  # the door's own build: built once per run
            return self.transformers_tokenizer
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.folder)

    # -- texts to embed ---------------------------------------------------------------------
    def prompt(self, name: str | None) -> str:
        """The text put before every text, as sentence-transformers' encode(prompt_name=)
        does: the named prompt, or with no name the model's default one ("" if none)."""
        embedding = self.spec.embedding
        name = embedding.default_prompt_name if name is None else name
        if name is None:
            return ""
        if name not in embedding.prompts:
            known = ", ".join(sorted(embedding.prompts)) or "none"
            raise ExampleError(f"prompt name {name!r}: this model's prompts are {known}")
        return embedding.prompts[name]

    def tokenize_texts(
        self, texts: list[str], where: list[str], truncate: bool = True, direction: str = "right"
    ):
        """-> (token id arrays int64, truncated count): the tokenizer's own template
        (BERT's [CLS] ... [SEP], RoBERTa's <s> ... </s>, ...), cut to max_length as
        sentence-transformers cuts. Too long with truncate=False raises ExampleError naming
        the text; direction "left" keeps a text's end (TEI's option)."""
        for text, place in zip(texts, where):
            check_text(text, place, empty_ok=True)
        inputs = [t.lower() for t in texts] if self.spec.embedding.lowercase else texts
        encoded, long = encode_within(
            self.tokenizer, inputs, self.max_length, truncate, direction, self._cutters
        )
        if long and not truncate:
            i = long[0]
            raise ExampleError(
                f"{where[i]}: {len(encoded[i].ids)} tokens; the model takes at most {self.max_length}"
            )
        return [np.asarray(e.ids, dtype=np.int64) for e in encoded], len(long)
