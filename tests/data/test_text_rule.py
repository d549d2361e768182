"""The text rule (data/text_rule.py): one decision for every door a text comes in by, and
written once (no reader keeps a copy of it)."""

from __future__ import annotations

import ast

from hypothesis import given
from hypothesis import strategies as st

from packed_transformers.data.text_rule import Fault, check_text, text_problem

from ..conftest import PACKAGE, REPO

SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_a_string_of_valid_unicode_is_refused_only_when_blank(text):
    problem = text_problem(text)
    assert (problem is None) == bool(text.strip())
    assert problem is None or problem.fault is Fault.EMPTY
    assert text_problem(text, empty_ok=True) is None


@given(st.text(max_size=10), SURROGATES, st.text(max_size=10))
def test_a_lone_surrogate_is_named_with_its_place(before, surrogate, after):
    text = "x" + before + surrogate + after
    problem = text_problem(text)
    first = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
    assert problem.fault is Fault.NOT_UNICODE
    assert problem.position == first and problem.code_point == ord(text[first])
    line = problem.message("f.jsonl:3: field 'text'")
    assert (
        line.startswith("f.jsonl:3: field 'text': not valid Unicode (a lone surrogate U+")
        and "\n" not in line
    )


@given(st.one_of(st.integers(), st.floats(allow_nan=False), st.lists(st.text(max_size=3), max_size=2),
                 st.dictionaries(st.text(max_size=2), st.integers(), max_size=2), st.none(), st.booleans()))  # fmt: skip
def test_anything_but_a_string_is_refused_naming_its_type(value):
    problem = text_problem(value)
    assert problem.fault is Fault.NOT_A_STRING
    assert problem.message("row 4: column 'text'").startswith("row 4: column 'text' must be a string, got ")
    assert text_problem(None, none_ok=True) is None


def test_the_bound_is_inclusive_and_named():
    assert text_problem("ab", limit=2) is None
    problem = text_problem("abc", limit=2)
    assert (problem.fault, problem.chars, problem.limit) == (Fault.TOO_LONG, 3, 2)
    assert problem.message("inputs[1]").startswith(
        "inputs[1] has 3 characters, more than the 2 read per text"
    )


def test_check_text_returns_the_text_or_raises_one_line():
    from packed_transformers.data.text_rule import ExampleError

    assert check_text("fine", "x") == "fine"
    try:
        check_text(" ", "bad.jsonl:2: field 'text'")
    except ExampleError as err:
        assert str(err) == "bad.jsonl:2: field 'text' is empty"
    else:
        raise AssertionError("a blank text passed")


def modules_with_their_own_text_rule() -> list[str]:
    """Files outside data/text_rule.py that decide "valid Unicode" themselves (catch a
    UnicodeEncodeError) or compare a length with MAX_FIELD_CHARS."""
    found = []
    for package in ("data", "finetune", "serving", "model", "common"):
        for path in sorted((PACKAGE / package).glob("*.py")):
            if path.name == "text_rule.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ExceptHandler) and "UnicodeEncodeError" in ast.unparse(
                    node.type or node
                ):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: catches UnicodeEncodeError")
                if isinstance(node, ast.Compare) and "MAX_FIELD_CHARS" in ast.unparse(node):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_reader_keeps_its_own_copy_of_the_rule():
    assert modules_with_their_own_text_rule() == []


def test_the_walker_finds_a_copy():
    planted = REPO / "packed_transformers" / "finetune" / "_planted_text_rule.py"
    planted.write_text(
        "def f(t):\n    try:\n        t.encode('utf-8')\n    except UnicodeEncodeError:\n        raise\n"
    )
    try:
        assert modules_with_their_own_text_rule() == [
            "finetune/_planted_text_rule.py:4: catches UnicodeEncodeError"
        ]
    finally:
        planted.unlink()
