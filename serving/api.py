"""The HTTP API's requests, read strictly: one-line errors with an HTTP status.

Classification is text-embeddings-inference's `/predict` (router/src/http/types.rs), so
its clients work unchanged:

    {"inputs": "a text"}                            one input
    {"inputs": ["a text", "its pair"]}              one input, a pair
    {"inputs": [["text"], ["text", "pair"], ...]}   a batch of singles and pairs
    optional: "truncate": bool (default false: too long is 413), "raw_scores": bool
    -> one input: [{"score", "label"}, ...] every label, best first; a batch: a list of those

Question answering has no TEI endpoint; `/qa` takes the transformers pipeline's shape:

    {"inputs": {"question": ..., "context": ...}}  or  {"inputs": [{...}, ...]}
    -> {"score", "start", "end", "answer"} per question (a list for a list)
"""

from __future__ import annotations

import json
from dataclasses import dataclass


class RequestError(Exception):
    """A request the server refuses: status (413, 422, 429, ...) and a one-line reason."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class RequestLimits:
    """max_body_bytes: a larger body is 413 before it is parsed; max_inputs: inputs per
    request (TEI's --max-client-batch-size, default 32); max_chars: characters per input."""

    max_body_bytes: int = 1 << 20
    max_inputs: int = 32
    max_chars: int = 100_000


def read_json(body: bytes, limits: RequestLimits) -> dict:
    if len(body) > limits.max_body_bytes:
        raise RequestError(
            413, f"the body has {len(body)} bytes; at most {limits.max_body_bytes} are accepted"
        )
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(422, f"the body is not JSON ({err})") from None
    if not isinstance(data, dict) or "inputs" not in data:
        raise RequestError(422, 'expected a JSON object with the field "inputs"')
    return data


def _flag(data: dict, name: str) -> bool:
    value = data.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(422, f'field "{name}": expected true or false, got {json.dumps(value)[:40]}')
    return value


def _text(value, where: str, limits: RequestLimits) -> str:
    if not isinstance(value, str):
        raise RequestError(422, f"{where}: expected a string, got {type(value).__name__}")
    if not value.strip():
        raise RequestError(422, f"{where}: the text is empty")
    if len(value) > limits.max_chars:
        raise RequestError(413, f"{where}: {len(value)} characters; at most {limits.max_chars} are accepted")
    return value


def _count(n: int, limits: RequestLimits) -> None:
    if n == 0:
        raise RequestError(422, 'field "inputs": the batch is empty')
    if n > limits.max_inputs:
        raise RequestError(413, f'field "inputs": {n} inputs; at most {limits.max_inputs} per request')


def parse_predict(data: dict, limits: RequestLimits) -> tuple[list[tuple[str, str | None]], bool, bool, bool]:
    """TEI's PredictRequest -> ([(text, pair or None)], single, truncate, raw_scores)."""
    inputs = data["inputs"]
    truncate, raw_scores = _flag(data, "truncate"), _flag(data, "raw_scores")
    if isinstance(inputs, str):
        return [(_text(inputs, "inputs", limits), None)], True, truncate, raw_scores
    if not isinstance(inputs, list) or not inputs:
        raise RequestError(
            422,
            'field "inputs": expected a string, a pair [string, string] or a batch [[string], [string, string], ...]',
        )
    if isinstance(inputs[0], str):  # TEI: a first element that is a string makes a single input
        if len(inputs) > 2:
            raise RequestError(422, f'field "inputs": a pair has 2 strings, got {len(inputs)}')
        texts = [_text(v, f"inputs[{i}]", limits) for i, v in enumerate(inputs)]
        return [(texts[0], texts[1] if len(texts) == 2 else None)], True, truncate, raw_scores
    _count(len(inputs), limits)
    sequences = []
    for i, item in enumerate(inputs):
        if not isinstance(item, list) or len(item) not in (1, 2):
            raise RequestError(422, f"inputs[{i}]: expected [string] or [string, string]")
        texts = [_text(v, f"inputs[{i}][{j}]", limits) for j, v in enumerate(item)]
        sequences.append((texts[0], texts[1] if len(texts) == 2 else None))
    return sequences, False, truncate, raw_scores


def parse_qa(data: dict, limits: RequestLimits) -> tuple[list[dict], bool]:
    """{"inputs": {question, context} or a list of them} -> (questions, single)."""
    inputs = data["inputs"]
    single = isinstance(inputs, dict)
    items = [inputs] if single else inputs
    if not isinstance(items, list):
        raise RequestError(422, 'field "inputs": expected {"question", "context"} or a list of them')
    _count(len(items), limits)
    out = []
    for i, item in enumerate(items):
        where = "inputs" if single else f"inputs[{i}]"
        if not isinstance(item, dict) or set(item) - {"question", "context"} or len(item) != 2:
            raise RequestError(422, f'{where}: expected an object with exactly "question" and "context"')
        out.append(
            {
                "question": _text(item["question"], f"{where}.question", limits),
                "context": _text(item["context"], f"{where}.context", limits),
            }
        )
    return out, single
