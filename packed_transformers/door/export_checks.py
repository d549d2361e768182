"""An exported folder checked as untrusted input before anything of it runs (issue 108).

A folder `packed export` wrote travels: copied, downloaded, cut short by a full disk, edited by
hand. Everything of packed_export.json and the files it names is checked here, and anything
wrong is one line (ExampleError) naming the file and the key or what is wrong with it:

    data = read_export_json(path)          # a JSON object; deep nesting, a link, a huge file refused
    check_export_fields(path, data)        # every key's type and range, the spec's nested keys,
                                           # the graph's name confined to the folder, labels = dimension
    check_file_sizes(folder, data)         # each recorded file there, a plain file, of its size
    check_file_digests(folder, data)       # and of its sha256 (at load: a graph is read once)

Limits are a table (LIMITS): a value outside them is a damaged file, not a model (a
`max_input_length` of 10^12 asked numpy for 7 TiB). `files` (each file's size and sha256) is
written by exports since issue 108; a folder exported before has none and is checked by its
keys alone. Standard library only: never torch, transformers or a graph runtime.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from packed_transformers.common.choices import GRAPH_TASKS, POOLING_MODES
from packed_transformers.data.classification_data import ExampleError

# packed_export.json is a few kB (a classifier's label table: a few MB at most)
MAX_EXPORT_JSON_BYTES = 16 * 2**20
# what an export's graph is run by, and in which precisions (inference.onnx_session,
# inference.openvino_session)
EXPORT_DTYPES_OF = {"onnxruntime": ("float32", "int8"), "openvino": ("float32", "bfloat16", "int8")}
EXPORT_RUNTIMES = tuple(EXPORT_DTYPES_OF)
EXPORT_DTYPES = tuple(dict.fromkeys(d for dtypes in EXPORT_DTYPES_OF.values() for d in dtypes))
# the graph's outputs and the task each belongs to (door.exported_folder.COMMAND_OF_OUTPUT)
TASK_OF_OUTPUT = {"embeddings": "embedding", "logits": "classification"}
# the files an export may record a digest of
RECORDED_FILES = ("model.onnx", "model.xml", "model.bin", "tokenizer.json", "vocab.txt")


@dataclass(frozen=True)
class Whole:
    """An integer key's allowed range (bool is no integer here)."""

    low: int
    high: int


# packed_export.json's integer keys -> their range: far beyond any model, far below absurd
LIMITS = {
    "dimension": Whole(1, 2**16),
    "hidden_size": Whole(1, 2**16),
    "parameters": Whole(1, 2**42),
    "max_input_length": Whole(2, 2**20),
}
# spec's integer keys that may also be null
SPEC_LIMITS = {
    "max_sequence_length": Whole(1, 2**20),
    "pack_length": Whole(1, 2**20),
    "length_cap": Whole(1, 2**31),
}


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _plain_file(path: Path) -> str | None:
    """Why `path` is not a plain file of the folder (missing, a link, a folder, a device), or None."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing (the export is incomplete; export the model again)"
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if stat.S_ISLNK(mode):
        return "a symbolic link; an exported folder holds its own files (copy them, not links)"
    if not stat.S_ISREG(mode):
        return "not a plain file"
    return None


def read_export_json(path: Path) -> dict:
    """packed_export.json as a dict: a plain file, at most MAX_EXPORT_JSON_BYTES, valid UTF-8
    JSON of a bounded depth, an object; else ExampleError naming `path`."""
    problem = _plain_file(path)
    if problem:
        raise ExampleError(f"{path}: {problem}")
    size = path.stat().st_size
    if size > MAX_EXPORT_JSON_BYTES:
        raise ExampleError(
            f"{path}: {size:,} bytes; an export's description is at most {MAX_EXPORT_JSON_BYTES:,}"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ExampleError(f"{path}: JSON nested too deep to be an export's description") from None
    except (OSError, ValueError) as err:
        raise ExampleError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ExampleError(f"{path}: expected a JSON object")
    return data


def _check(path: Path, key: str, ok: bool, expected: str, value) -> None:
    if not ok:
        shown = json.dumps(value)[:80] if not isinstance(value, float) else repr(value)
        raise ExampleError(f"{path}: {key} is {shown}; expected {expected}")


def _check_whole(path: Path, key: str, value, limit: Whole, nullable: bool = False) -> None:
    if nullable and value is None:
        return
    ok = _is_whole(value) and limit.low <= value <= limit.high
    _check(
        path,
        key,
        ok,
        f"an integer from {limit.low:,} to {limit.high:,}" + (" or null" if nullable else ""),
        value,
    )


def _check_spec(path: Path, spec: dict, outputs: list, dimension: int) -> None:
    """spec: the exported FolderSpec's fields (door.exported_folder.spec_fields), each checked."""
    for key in ("task", "labels", "multi_label", "too_long", "fields", "tokenizer", "embedding"):
        if key not in spec:
            raise ExampleError(f"{path}: missing key 'spec.{key}'")
    task = spec["task"]
    _check(path, "spec.task", task in GRAPH_TASKS, f"one of {list(GRAPH_TASKS)}", task)
    wanted = {TASK_OF_OUTPUT[o] for o in outputs}
    _check(
        path,
        "spec.task",
        wanted == {task},
        f"{' or '.join(sorted(wanted))} (the graph's outputs {outputs})",
        task,
    )
    labels = spec["labels"]
    _check(path, "spec.labels", isinstance(labels, list) and all(isinstance(x, str) for x in labels),
           "a list of label names", labels)  # fmt: skip
    if task == "classification" and labels and len(labels) != dimension:
        raise ExampleError(
            f"{path}: spec.labels names {len(labels)} classes; the graph scores dimension={dimension}"
        )
    _check(
        path, "spec.multi_label", isinstance(spec["multi_label"], bool), "true or false", spec["multi_label"]
    )
    _check(
        path,
        "spec.too_long",
        spec["too_long"] in ("truncate", "error"),
        '"truncate" or "error"',
        spec["too_long"],
    )
    _check(path, "spec.tokenizer", spec["tokenizer"] in ("vocab.txt", "tokenizer.json"),
           '"vocab.txt" or "tokenizer.json"', spec["tokenizer"])  # fmt: skip
    for key, limit in SPEC_LIMITS.items():
        _check_whole(path, f"spec.{key}", spec.get(key), limit, nullable=True)
    fields = spec["fields"]
    _check(path, "spec.fields", isinstance(fields, dict), "an object {text, pair, label}", fields)
    if "text" not in fields:
        raise ExampleError(f"{path}: missing key 'spec.fields.text'")
    _check(path, "spec.fields.text", isinstance(fields["text"], str) and fields["text"] != "", "a field name",
           fields["text"])  # fmt: skip
    for key in ("pair", "label"):
        value = fields.get(key)
        _check(
            path, f"spec.fields.{key}", value is None or isinstance(value, str), "a field name or null", value
        )
    unknown = sorted(set(fields) - {"text", "pair", "label"})
    if unknown:
        raise ExampleError(
            f"{path}: spec.fields has an unknown key {unknown[0]!r}; expected text, pair, label"
        )
    for key in ("qa", "config"):
        value = spec.get(key)
        _check(path, f"spec.{key}", value is None or isinstance(value, dict), "an object or null", value)
    _check(path, "spec.model_config", isinstance(spec.get("model_config", {}), dict), "an object",
           spec.get("model_config"))  # fmt: skip
    for key in ("name", "model_type"):
        value = spec.get(key)
        _check(path, f"spec.{key}", value is None or isinstance(value, str), "a string", value)
    embedding = spec["embedding"]
    if task == "embedding" or embedding is not None:
        _check_embedding(path, embedding)


def _check_embedding(path: Path, embedding) -> None:
    _check(
        path, "spec.embedding", isinstance(embedding, dict), "an object (how texts become vectors)", embedding
    )
    for key in ("pooling", "normalize"):
        if key not in embedding:
            raise ExampleError(f"{path}: missing key 'spec.embedding.{key}'")
    pooling = embedding["pooling"]
    _check(path, "spec.embedding.pooling",
           isinstance(pooling, list) and 0 < len(pooling) <= len(POOLING_MODES) and all(p in POOLING_MODES for p in pooling),
           f"a list of {list(POOLING_MODES)}", pooling)  # fmt: skip
    for key in ("normalize", "lowercase"):
        value = embedding.get(key, False)
        _check(path, f"spec.embedding.{key}", isinstance(value, bool), "true or false", value)
    prompts = embedding.get("prompts", {})
    _check(path, "spec.embedding.prompts",
           isinstance(prompts, dict) and all(isinstance(v, str) for v in prompts.values()),
           "an object of prompt texts", prompts)  # fmt: skip
    default = embedding.get("default_prompt_name")
    _check(path, "spec.embedding.default_prompt_name", default is None or default in prompts,
           "null or one of spec.embedding.prompts", default)  # fmt: skip
    unknown = sorted(set(embedding) - {"pooling", "normalize", "lowercase", "prompts", "default_prompt_name"})
    if unknown:
        raise ExampleError(f"{path}: spec.embedding has an unknown key {unknown[0]!r}")


def check_export_fields(path: Path, data: dict) -> None:
    """Every key of packed_export.json (read_export_json's dict; `format` and the keys' presence
    already checked) of the type and in the range an export writes; ExampleError naming the key."""
    _check(
        path,
        "runtime",
        data["runtime"] in EXPORT_RUNTIMES,
        f"one of {list(EXPORT_RUNTIMES)}",
        data["runtime"],
    )
    dtypes = EXPORT_DTYPES_OF[data["runtime"]]
    _check(
        path,
        "dtype",
        data["dtype"] in dtypes,
        f"one of {list(dtypes)} (runtime {data['runtime']})",
        data["dtype"],
    )
    graph = data["graph"]
    confined = (isinstance(graph, str) and graph not in ("", ".", "..") and "/" not in graph and "\\" not in graph
                and "\0" not in graph)  # fmt: skip
    _check(path, "graph", confined, "a file name inside the folder (no path)", graph)
    outputs = data["outputs"]
    _check(path, "outputs",
           isinstance(outputs, list) and len(outputs) == 1 and all(o in TASK_OF_OUTPUT for o in outputs),
           f"one of {[[o] for o in TASK_OF_OUTPUT]}", outputs)  # fmt: skip
    for key, limit in LIMITS.items():
        _check_whole(path, key, data[key], limit)
    _check(path, "token_types", isinstance(data["token_types"], bool), "true or false", data["token_types"])
    _check(path, "source", isinstance(data["source"], dict), "an object", data["source"])
    spec = data["spec"]
    _check(path, "spec", isinstance(spec, dict), "an object (the model folder's description)", spec)
    _check_spec(path, spec, outputs, data["dimension"])
    files = data.get("files", {})
    _check(path, "files", isinstance(files, dict), "an object {file: {bytes, sha256}}", files)
    for name, entry in files.items():
        _check(path, "files", name in (*RECORDED_FILES, graph), f"names of the folder's files {list(RECORDED_FILES)}",
               name)  # fmt: skip
        ok = (isinstance(entry, dict) and _is_whole(entry.get("bytes")) and entry["bytes"] >= 0
              and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64)  # fmt: skip
        _check(path, f"files.{name}", ok, "an object {bytes, sha256}", entry)


def check_file_sizes(folder: Path, data: dict) -> None:
    """The graph, tokenizer.json and each recorded file: there, plain files of the folder, of
    their recorded size (a copy cut short fails here, before anything reads it)."""
    files = data.get("files", {})
    for name in dict.fromkeys((data["graph"], "tokenizer.json", *files)):
        path = folder / name
        problem = _plain_file(path)
        if problem:
            raise ExampleError(f"{path}: {problem}")
        if name in files and path.stat().st_size != files[name]["bytes"]:
            raise ExampleError(
                f"{path}: {path.stat().st_size:,} bytes, {files[name]['bytes']:,} when exported "
                "(a copy cut short or another file; export the model again)"
            )


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def recorded_files(folder: Path, names) -> dict:
    """{name: {bytes, sha256}} of the files `names` of `folder` (what an export records)."""
    return {
        name: {"bytes": (folder / name).stat().st_size, "sha256": file_digest(folder / name)}
        for name in names
    }


def check_file_digests(folder: Path, data: dict) -> None:
    """Each recorded file's sha256 as exported (another model's tokenizer.json of the same size
    fails here)."""
    for name, entry in data.get("files", {}).items():
        if file_digest(folder / name) != entry["sha256"]:
            raise ExampleError(
                f"{folder / name}: not the file this folder was exported with (its sha256 differs from "
                f"{folder / 'packed_export.json'}'s); export the model again"
            )
