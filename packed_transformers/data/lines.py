"""Lines of a JSON-lines input, read with a bound: the one reader every command's file input
goes through (pack-documents, train-tokenizer, predict, train, embed).

A file object's own iteration reads a line whole however long it is: an input with no newline
(`/dev/zero`, a binary file, one huge JSON array) is one endless line, and the process grows
until the kernel's OOM killer ends it (24.3 GB before this reader). `bounded_lines` reads at
most MAX_LINE_BYTES + 1 bytes a line and refuses a longer one naming file:line, so memory is
bounded by the limit, not by the input.
"""

from __future__ import annotations

from collections.abc import Iterator

from packed_transformers.data.text_rule import MAX_FIELD_CHARS, ExampleError

# The longest line read: a text of MAX_FIELD_CHARS characters written as JSON escapes
# (`\uXXXX` pairs: 12 bytes a character at worst) and room for other fields.
MAX_LINE_BYTES = 12 * MAX_FIELD_CHARS + (1 << 20)


def bounded_lines(f, where: str, limit: int = MAX_LINE_BYTES) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, the line's bytes with its newline) of a binary file object;
    ExampleError naming `where`:line for a line of more than `limit` bytes."""
    number = 0
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        number += 1
        if len(raw) > limit:
            raise ExampleError(
                f"{where}:{number}: a line of more than {limit:,} bytes (no newline within them); expected "
                "one JSON object a line"
            )
        yield number, raw
