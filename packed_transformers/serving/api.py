"""The HTTP API's requests, read strictly: one-line errors with an HTTP status.

Classification is text-embeddings-inference's `/predict` (router/src/http/types.rs), so
its clients work unchanged:

    {"inputs": "a text"}                            one input
    {"inputs": ["a text", "its pair"]}              one input, a pair
    {"inputs": [["text"], ["text", "pair"], ...]}   a batch of singles and pairs
    optional: "truncate": bool (default false: too long is 413), "raw_scores": bool
    -> one input: [{"score", "label"}, ...] every label, best first; a batch: a list of those

Embeddings are TEI's `/embed` and OpenAI's `/v1/embeddings`; reranking is TEI's `/rerank`:

    /embed {"inputs": "a text" | ["a text", ...]}  optional: "normalize" (default true),
        "truncate" (default false), "truncation_direction": "right" | "left"
        -> [[float, ...], ...] one embedding per input, a single string included
    /v1/embeddings {"input": "a text" | [...], "model": ..., "encoding_format": "float" |
        "base64", "dimensions": n}  -> {"object": "list", "data": [{"object": "embedding",
        "index": i, "embedding": [...] or base64 of float32}], "model", "usage"}
    /rerank {"query": ..., "texts": [...]}  optional: "raw_scores", "return_text",
        "truncate", "truncation_direction" -> [{"index", "score"(, "text")}] best first

Question answering has no TEI endpoint; `/qa` takes the transformers pipeline's shape:

    {"inputs": {"question": ..., "context": ...}}  or  {"inputs": [{...}, ...]}
    -> {"score", "start", "end", "answer"} per question (a list for a list)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from packed_transformers.common import json_text
from packed_transformers.data.text_rule import Fault, text_problem


class RequestError(Exception):
    """A request the server refuses: status (413, 422, 429, ...) and a one-line reason."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class RequestLimits:
    """max_body_bytes: a larger body is 413 before it is parsed; max_inputs: inputs per
    request (TEI's --max-client-batch-size, default 32); max_chars: characters per input;
    body_timeout_s: seconds the whole body may take to arrive (408 after)."""

    max_body_bytes: int = 1 << 20
    max_inputs: int = 32
    max_chars: int = 100_000
    body_timeout_s: float = 10.0


def read_json(body: bytes, limits: RequestLimits, required: str = "inputs") -> dict:
    if len(body) > limits.max_body_bytes:
        raise RequestError(
            413, f"the body has {len(body)} bytes; at most {limits.max_body_bytes} are accepted"
        )
    try:
        data = json_text.loads(body)
    except json.JSONDecodeError as err:  # (doc "": json_text's own refusals have no position)
        raise RequestError(422, f"the body is not JSON ({err if err.doc else err.msg})") from None
    except UnicodeDecodeError as err:
        raise RequestError(422, f"the body is not JSON ({err})") from None
    if not isinstance(data, dict) or required not in data:
        raise RequestError(422, f'expected a JSON object with the field "{required}"')
    return data


@dataclass(frozen=True)
class Request:
    """A request read strictly, as every engine takes it (serving/engines.py: prepare(request),
    answer(prepared, outputs)).

    route: "predict" | "rerank" | "qa" | "tokens" | "embed" | "openai"; inputs: texts,
    (text, pair or None) tuples (predict, rerank) or {"question", "context"} dicts (qa);
    single: the input was given alone (answered alone); truncate: cut what is too long
    instead of 413; options: the route's own flags (raw_scores, return_text, normalize,
    direction, encoding, dimensions)."""

    route: str
    inputs: list
    single: bool = False
    truncate: bool = False
    options: dict = field(default_factory=dict)


def _flag(data: dict, name: str) -> bool:
    value = data.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(422, f'field "{name}": expected true or false, got {json.dumps(value)[:40]}')
    return value


def _text(value, where: str, limits: RequestLimits) -> str:
    problem = text_problem(value, limit=limits.max_chars)  # data.text_rule, as the commands apply it
    if problem is not None:
        raise RequestError(413 if problem.fault is Fault.TOO_LONG else 422, problem.message(where))
    return value


def _count(n: int, limits: RequestLimits, field: str = "inputs") -> None:
    if n == 0:
        raise RequestError(422, f'field "{field}": the batch is empty')
    if n > limits.max_inputs:
        raise RequestError(413, f'field "{field}": {n} inputs; at most {limits.max_inputs} per request')


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


def _direction(data: dict) -> str:
    value = data.get("truncation_direction", "right")
    if not isinstance(value, str) or value.lower() not in ("right", "left"):
        raise RequestError(
            422, f'field "truncation_direction": expected "right" or "left", got {json.dumps(value)[:40]}'
        )
    return value.lower()


def _texts(inputs, field: str, limits: RequestLimits) -> list[str]:
    """A string or a non-empty list of strings -> the list."""
    if isinstance(inputs, str):
        return [_text(inputs, field, limits)]
    if not isinstance(inputs, list):
        raise RequestError(422, f'field "{field}": expected a string or a list of strings')
    _count(len(inputs), limits, field)
    return [_text(v, f"{field}[{i}]", limits) for i, v in enumerate(inputs)]


def parse_embed(data: dict, limits: RequestLimits) -> tuple[list[str], bool, str, bool]:
    """TEI's EmbedRequest -> (texts, truncate, truncation direction, normalize)."""
    normalize = data.get("normalize", True)
    if not isinstance(normalize, bool):
        raise RequestError(
            422, f'field "normalize": expected true or false, got {json.dumps(normalize)[:40]}'
        )
    return _texts(data["inputs"], "inputs", limits), _flag(data, "truncate"), _direction(data), normalize


def parse_tokens(data: dict, limits: RequestLimits) -> tuple[list[str], bool, bool]:
    """{"inputs": text or [texts], "truncate"} -> (texts, single, truncate): token
    classification, answered per text as transformers' token-classification pipeline."""
    inputs = data["inputs"]
    return _texts(inputs, "inputs", limits), isinstance(inputs, str), _flag(data, "truncate")


def parse_openai_embeddings(
    data: dict, limits: RequestLimits, dimension: int
) -> tuple[list[str], str, int | None]:
    """OpenAI's embeddings request -> (texts, encoding_format, dimensions or None). Token-id
    inputs are refused (this server tokenizes itself); "model" and "user" are accepted as any string."""
    for name in ("model", "user"):
        if name in data and not isinstance(data[name], str):
            raise RequestError(422, f'field "{name}": expected a string')
    encoding = data.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise RequestError(
            422, f'field "encoding_format": expected "float" or "base64", got {json.dumps(encoding)[:40]}'
        )
    dimensions = data.get("dimensions")
    if dimensions is not None and (
        not isinstance(dimensions, int) or isinstance(dimensions, bool) or not 1 <= dimensions <= dimension
    ):
        raise RequestError(
            422,
            f'field "dimensions": expected an integer from 1 to {dimension}, got {json.dumps(dimensions)[:40]}',
        )
    return _texts(data["input"], "input", limits), encoding, dimensions


def parse_rerank(data: dict, limits: RequestLimits) -> tuple[list[tuple[str, str]], bool, bool, bool, str]:
    """TEI's RerankRequest -> ([(query, text)], truncate, raw_scores, return_text, direction)."""
    query = _text(data["query"], "query", limits)
    texts = data.get("texts")
    if not isinstance(texts, list):
        raise RequestError(422, 'field "texts": expected a list of strings')
    texts = _texts(texts, "texts", limits)
    flags = [_flag(data, name) for name in ("truncate", "raw_scores", "return_text")]
    return [(query, text) for text in texts], *flags, _direction(data)


# The fields each route takes (TEI's PredictRequest, RerankRequest and EmbedRequest as far as
# this server implements them; OpenAI's embeddings request with sentence-transformers'
# prompt_name): any other is refused with 422, as OpenAI answers an unknown parameter, rather
# than ignored (a misspelt "normalise", or another API's "top_n" on /rerank, would silently
# do nothing).
ROUTE_FIELDS: dict[str, frozenset[str]] = {
    "predict": frozenset({"inputs", "truncate", "raw_scores"}),
    "rerank": frozenset({"query", "texts", "truncate", "raw_scores", "return_text", "truncation_direction"}),
    "qa": frozenset({"inputs"}),
    "tokens": frozenset({"inputs", "truncate"}),
    "embed": frozenset({"inputs", "normalize", "truncate", "truncation_direction", "prompt_name"}),
    "openai": frozenset({"input", "model", "encoding_format", "dimensions", "user", "prompt_name"}),
}


def unknown_field(route: str, data: dict) -> str | None:
    """The first field of `data` the route does not take, or None."""
    return next((name for name in sorted(data) if name not in ROUTE_FIELDS[route]), None)


def _prompt_name(data: dict) -> str | None:
    """The "prompt_name" field (a prompt of the model's configuration), or None."""
    prompt_name = data.get("prompt_name")
    if prompt_name is not None and not isinstance(prompt_name, str):
        raise RequestError(422, f'field "prompt_name": expected a string, got {json.dumps(prompt_name)[:40]}')
    return prompt_name


def read_request(route: str, data: dict, limits: RequestLimits, dimension: int | None = None) -> Request:
    """A route's JSON body (already parsed) -> its Request; RequestError (one line) if it is
    not what the route takes. dimension: an embedding model's, for OpenAI's `dimensions`."""
    unknown = unknown_field(route, data)
    if unknown is not None:
        raise RequestError(
            422,
            f'field "{unknown[:40]}": not a field of this route; it takes {", ".join(sorted(ROUTE_FIELDS[route]))}',
        )
    if route == "predict":
        sequences, single, truncate, raw_scores = parse_predict(data, limits)
        return Request(route, sequences, single, truncate, {"raw_scores": raw_scores})
    if route == "rerank":
        pairs, truncate, raw_scores, return_text, direction = parse_rerank(data, limits)
        return Request(route, pairs, False, truncate, {"raw_scores": raw_scores, "return_text": return_text})
    if route == "qa":
        questions, single = parse_qa(data, limits)
        return Request(route, questions, single)
    if route == "tokens":
        texts, single, truncate = parse_tokens(data, limits)
        return Request(route, texts, single, truncate)
    if route == "embed":
        texts, truncate, direction, normalize = parse_embed(data, limits)
        options = {"direction": direction, "normalize": normalize, "prompt_name": _prompt_name(data)}
        return Request(route, texts, False, truncate, options)
    texts, encoding, dimensions = parse_openai_embeddings(data, limits, dimension)
    options = {"encoding": encoding, "dimensions": dimensions, "prompt_name": _prompt_name(data)}
    return Request("openai", texts, False, False, options)
