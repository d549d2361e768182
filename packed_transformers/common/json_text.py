"""JSON that a user hands us, parsed so that every failure is a JSONDecodeError.

Python's parser recurses once per nesting level: `[[[[...` a few thousand deep (a 10 kB
line, well under any size limit) raises RecursionError, which no reader's
`except json.JSONDecodeError` expects, and would surface as a traceback or an HTTP 500.
A key given twice in one object is refused too (json.loads keeps the last one and drops
the other silently; TEI's serde refuses it as well). An integer of more than
common.input_limits.MAX_INT_DIGITS digits is one too: Python's int conversion raises a bare
ValueError past that limit, which the server answered as a 500 and the commands as tracebacks.
"""

from __future__ import annotations

import json

from packed_transformers.common.input_limits import MAX_INT_DIGITS


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    found = dict(pairs)
    if len(found) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise json.JSONDecodeError(f"duplicate key {json.dumps(key)[:40]}", "", 0)
            seen.add(key)
    return found


def loads(text: str | bytes):
    """json.loads; nesting too deep for the parser, a duplicate key in an object and an
    integer past MAX_INT_DIGITS are JSONDecodeErrors ("nested too deeply", "duplicate key
    ...", "an integer of more than 4300 digits")."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", "", 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError as err:  # int("9" * 5000): the only ValueError json.loads lets through
        if "digits" not in str(err):
            raise
        raise json.JSONDecodeError(f"an integer of more than {MAX_INT_DIGITS} digits", "", 0) from None
