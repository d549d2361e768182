"""Language-model pretraining text: JSON lines as C4 ships them -> one token array per document.

    {"text": "Beginners BBQ Class Taking Place in Missoula! ...", "timestamp": ..., "url": ...}

A document's tokens are what the tokenizer folder's own template gives (Llama's BOS where its
tokenizer adds one) followed by the end-of-sequence token: the document's last target is
"the document ends", and the concatenated layout's separator (MLPerf's reference joins
documents with EOS). Fields other than `text` are ignored. An empty or blank text is a
document of no words: it is counted and left out (`DocumentTexts.blank`), never silently.

Pure data: a `tokenizers.Tokenizer` comes in (the door opens the folder), numpy arrays go out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from packed_transformers.data.classification_data import (
    ExampleError,
    bounded_lines,
    check_readable,
    example_of_line,
)


@dataclass
class DocumentTexts:
    """Documents in input order; where[i]: "file:line"; blank: the blank lines' places."""

    texts: list[str] = field(default_factory=list)
    where: list[str] = field(default_factory=list)
    blank: list[str] = field(default_factory=list)


def read_documents(paths: list[Path], text_field: str = "text") -> DocumentTexts:
    """Every non-empty line of every file, in order. ExampleError (one line naming file:line
    and the field) for a line that is not a JSON object with a string `text_field`."""
    out = DocumentTexts()
    for path in paths:
        path = Path(path)
        check_readable(path)
        with path.open("rb") as f:
            for number, raw in bounded_lines(f, str(path)):
                if not raw.strip():
                    continue
                where = f"{path}:{number}"
                text, _, _ = example_of_line(raw, where, text_field, None)
                if text.strip():
                    out.texts.append(text)
                    out.where.append(where)
                else:
                    out.blank.append(where)
    if not out.texts:
        raise ExampleError(f"{', '.join(map(str, paths))}: no document with text (field '{text_field}')")
    return out


def tokenize_documents(texts: list[str], tokenizer, eos_id: int, batch: int = 1024) -> list[np.ndarray]:
    """int32 token arrays, one per text: the tokenizer's encoding (its special-token
    template included) + [eos_id] unless the template already ends with it."""
    out = []
    for start in range(0, len(texts), batch):
        for encoding in tokenizer.encode_batch(texts[start : start + batch]):
            ids = encoding.ids
            if not ids or ids[-1] != eos_id:
                ids = [*ids, eos_id]
            out.append(np.asarray(ids, dtype=np.int32))
    return out
