"""JSON-lines inputs a user gets wrong (invalid unicode, too deep, a key twice, a missing text
field, a huge field): one line naming file, line and field."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize(
    "line, says",
    [
        ('{"text": "a \\ud800 b", "label": "x"}', ":2: field 'text': not valid Unicode (a lone surrogate U+D800 at character 2)"),
        ('{"text": "fine", "pair": "\\udfff", "label": "x"}', ":2: field 'pair': not valid Unicode (a lone surrogate U+DFFF"),
    ],
)  # fmt: skip
def test_json_lines_with_invalid_unicode_name_file_line_and_field(tmp_path, line, says):
    """What finetune.train and commands.predict read (data.classification_data.read_jsonl):
    JSON may escape a lone UTF-16 surrogate; no tokenizer can encode it."""
    from packed_transformers.data.classification_data import ExampleError, read_jsonl

    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "fine", "label": "x"}\n' + line + "\n")
    with pytest.raises(ExampleError) as refused:
        read_jsonl(path, "text", "pair", "label")
    assert str(refused.value).startswith(str(path)) and says in str(refused.value)


DEEP = "[" * 20000 + "]" * 20000  # 40 kB: Python's JSON parser recurses once per level


@pytest.mark.parametrize("line, says", [
    ('{"text": "a", "label": "x", "extra": ' + DEEP + "}", ":2: not valid JSON (nested too deeply)"),
    ('{"text": "a", "text": "b", "label": "x"}', ':2: not valid JSON (duplicate key "text")'),
])  # fmt: skip
def test_json_lines_too_deep_or_with_a_duplicate_key_are_one_line(tmp_path, line, says):
    """Every JSON-lines reader (classification, SQuAD lines, the embed command): a
    RecursionError from the parser, or a key given twice, is one line naming file:line."""
    from packed_transformers.commands.embed import read_texts
    from packed_transformers.data.classification_data import ExampleError, read_jsonl
    from packed_transformers.data.qa_data import read_squad

    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "fine", "label": "x"}\n' + line + "\n")
    for read in (lambda: read_jsonl(path, "text", "pair", "label"), lambda: list(read_texts(path, "text"))):
        with pytest.raises(ExampleError) as refused:
            read()
        assert str(refused.value).startswith(str(path)) and says in str(refused.value)
    squad = tmp_path / "squad.jsonl"
    squad.write_text(line.replace('"label": "x"', '"id": "q", "question": "q?", "context": "c"') + "\n")
    with pytest.raises(ExampleError, match="not valid JSON"):
        read_squad(squad)


def test_a_line_without_its_text_field_says_missing_and_what_it_has(tmp_path):
    from packed_transformers.data.classification_data import ExampleError
    from packed_transformers.finetune.causal_lm_task import read_prompt_completions

    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(
        ExampleError, match=r"chat.jsonl:1: field 'prompt' is missing \(the line's fields: 'messages'\)$"
    ):
        read_prompt_completions(path, "prompt", "completion")


def test_a_huge_text_field_is_refused_before_tokenizing(tmp_path):
    """#14: a 20 MB line was tokenized whole (3.4 GB)."""
    from packed_transformers.data.classification_data import MAX_FIELD_CHARS, ExampleError, read_jsonl

    path = tmp_path / "in.jsonl"
    path.write_text(
        json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": "word " * (MAX_FIELD_CHARS // 5 + 1)}) + "\n"
    )
    with pytest.raises(ExampleError, match=r"in.jsonl:2: field 'text' has 1,000,005 characters"):
        read_jsonl(path, "text", "pair", "label", need_labels=False)
