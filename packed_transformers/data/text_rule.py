"""The text rule: what every reader accepts as one text to tokenize.

One decision for every door a text comes in by (commands.embed's and predict's JSON lines,
classification and QA files, the Ray batches, token tasks, the Hugging Face pipelines,
the server's requests): a text is a string, not blank unless the caller allows it, valid
Unicode (JSON can carry a lone UTF-16 surrogate, "\\ud800", which Python keeps in a str but
no tokenizer or UTF-8 can encode), and at most a bound of characters (a bound on
tokenizing one line: a 20 MB line took 3.4 GB to tokenize whole).

`text_problem` is the pure decision (None, or what is wrong, as a `TextProblem`);
`check_text` is the adapter the file readers use (ExampleError naming the place);
the server maps a problem to its status (413 for too long, else 422) in serving/api.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# Characters of one text that are read: far beyond any encoder's 512 tokens (~3,000
# characters of English); common.input_limits holds every input limit.
from packed_transformers.common.input_limits import MAX_FIELD_CHARS  # noqa: E402, F401 (read from here too)


class ExampleError(ValueError):
    """A problem with the user's data: one line naming the file and line (or row) and what
    was expected; the commands print it and exit 2."""


class Fault(enum.Enum):
    NOT_A_STRING = "not a string"
    EMPTY = "blank"
    NOT_UNICODE = "not valid Unicode"
    TOO_LONG = "too long"


@dataclass(frozen=True)
class TextProblem:
    """What is wrong with one text. `got`: the value's type and its start (NOT_A_STRING);
    `position`, `code_point`: the lone surrogate (NOT_UNICODE); `chars`, `limit` (TOO_LONG)."""

    fault: Fault
    got: str = ""
    position: int = 0
    code_point: int = 0
    chars: int = 0
    limit: int = 0

    def message(self, name: str) -> str:
        """One line; `name` says where and which text ("train.jsonl:5: field 'text'",
        "input 1: the context", "inputs[2]")."""
        match self.fault:
            case Fault.NOT_A_STRING:
                return f"{name} must be a string, got {self.got}"
            case Fault.EMPTY:
                return f"{name} is empty"
            case Fault.NOT_UNICODE:
                return (
                    f"{name}: not valid Unicode (a lone surrogate U+{self.code_point:04X} at character "
                    f"{self.position})"
                )
            case Fault.TOO_LONG:
                return (
                    f"{name} has {self.chars:,} characters, more than the {self.limit:,} read per text "
                    "(a model sees at most a few thousand tokens of it; split the text)"
                )
        raise AssertionError(self.fault)


def described(value) -> str:
    """A value that is not a string, for an error: its type and the start of it."""
    if value is None:
        return "None"
    return f"{type(value).__name__} {str(value)[:40]!r}"


def text_problem(
    value, empty_ok: bool = False, limit: int = MAX_FIELD_CHARS, none_ok: bool = False
) -> TextProblem | None:
    """None if `value` is an acceptable text, else what is wrong with it. `empty_ok`: a blank
    string is acceptable (predict gives it a label; embed and the server refuse it);
    `none_ok`: None is acceptable (a missing text pair)."""
    if value is None and none_ok:
        return None
    if not isinstance(value, str):
        return TextProblem(Fault.NOT_A_STRING, got=described(value))
    if not empty_ok and not value.strip():
        return TextProblem(Fault.EMPTY)
    if len(value) > limit:
        return TextProblem(Fault.TOO_LONG, chars=len(value), limit=limit)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        return TextProblem(Fault.NOT_UNICODE, position=err.start, code_point=ord(value[err.start]))
    return None


def check_text(value, name: str, empty_ok: bool = False, none_ok: bool = False):
    """`value` if it is an acceptable text (text_problem), else ExampleError naming `name`."""
    problem = text_problem(value, empty_ok=empty_ok, none_ok=none_ok)
    if problem is not None:
        raise ExampleError(problem.message(name))
    return value
