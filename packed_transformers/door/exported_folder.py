"""A folder `packed export` wrote, opened without torch or transformers: the packed graph,
the tokenizer and what the read-out needs, into the LoadedModel every command runs.

    DIR/packed_export.json   what the folder holds (ExportInfo; format EXPORT_FORMAT)
    DIR/model.onnx           the packed model: rows in, per-slot vectors or scores out
    DIR/tokenizer.json       the source folder's tokenizer (`tokenizers`), as it cut and templated texts
    DIR/vocab.txt            only for a finetune.train WordPiece folder (its pairs' rule)

    info = read_export(folder)              # ExampleError (one line) for anything else
    loaded = load_exported(folder)          # LoadedModel; loaded.model is an ExportedGraph

Everything the torch door decides once when it opens a folder (the task, labels, the length
limit, pooling, normalisation, prompts, lower-casing, token types) was decided by it when the
folder was exported, and is read back here as it was: the exported process cuts, packs and
reads out texts exactly as the torch process does (tests/inference/test_exported.py holds the
two equal). Imports: the standard library, numpy, `tokenizers`, and onnxruntime when the graph
is run (inference.onnx_session); never torch or transformers (tests assert it on sys.modules).
"""

from __future__ import annotations

import json
import types
from dataclasses import asdict, dataclass
from pathlib import Path

from packed_transformers.common.choices import EXPORTED, GRAPH_TASKS
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.door.folder_spec import EmbeddingSpec, FolderSpec, TextFields
from packed_transformers.door.loaded import LoadedModel

EXPORT_FORMAT = 1


@dataclass(frozen=True)
class ExportInfo:
    """packed_export.json: the graph and how texts reach it.

    runtime, dtype: what the graph is for ("onnxruntime"; "float32" | "int8"); graph: its file;
    outputs: the graph's outputs ("embeddings" [rows, K, D] | "logits" [rows, K, C]);
    dimension: D (embedding) or C (classification); hidden_size: the model's H (the packing's
    cost model reads it); parameters: the model's count (the server's cold speed estimate); max_input_length: tokens per text, specials included; token_types:
    whether the tokenizer's token types reach the model; spec: the source FolderSpec's fields
    (path left out); source: the folder exported and its fingerprint (common.files)."""

    format: int
    runtime: str
    dtype: str
    graph: str
    outputs: tuple[str, ...]
    dimension: int
    hidden_size: int
    parameters: int
    max_input_length: int
    token_types: bool
    spec: dict
    source: dict

    def to_json(self) -> dict:
        return asdict(self)


class ExportedGraph:
    """LoadedModel.model of an exported folder: the graph's file and the sizes the inference
    code reads of a model (`dimension`, `config.hidden_size`)."""

    def __init__(self, folder: Path, info: ExportInfo):
        self.path = folder / info.graph
        self.info = info
        self.dimension, self.parameter_count = info.dimension, info.parameters
        self.config = types.SimpleNamespace(hidden_size=info.hidden_size)


def is_exported(folder) -> bool:
    """Whether `folder` is one `packed export` wrote (its packed_export.json is there)."""
    return (Path(folder) / EXPORTED).is_file()


def spec_fields(spec: FolderSpec) -> dict:
    """What of a FolderSpec an export keeps (JSON): everything but the path."""
    fields = asdict(spec)
    fields.pop("path")
    fields["labels"] = list(spec.labels)
    return fields


def spec_of(folder: Path, fields: dict) -> FolderSpec:
    """The FolderSpec an export kept, at its new path."""
    fields = dict(fields)
    embedding = fields.pop("embedding")
    return FolderSpec(
        path=folder,
        **{**fields, "source": EXPORTED, "labels": tuple(fields["labels"]), "fields": TextFields(**fields["fields"])},
        embedding=None if embedding is None else EmbeddingSpec(**{**embedding, "pooling": tuple(embedding["pooling"])}),
    )  # fmt: skip


def read_export(folder) -> ExportInfo:
    """packed_export.json of `folder`, checked; ExampleError naming the file and key."""
    folder = Path(folder)
    path = folder / EXPORTED
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ExampleError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ExampleError(f"{path}: expected a JSON object")
    if data.get("format") != EXPORT_FORMAT:
        raise ExampleError(
            f"{path}: format {data.get('format')!r}; this version reads format {EXPORT_FORMAT} (export the model again)"
        )
    expected = {name for name in ExportInfo.__dataclass_fields__}
    missing = sorted(expected - set(data))
    if missing:
        raise ExampleError(f"{path}: missing key {missing[0]!r}")
    info = ExportInfo(**{name: data[name] for name in expected})
    info = ExportInfo(**{**asdict(info), "outputs": tuple(info.outputs)})
    if info.spec.get("task") not in GRAPH_TASKS:
        raise ExampleError(
            f"{path}: spec.task {info.spec.get('task')!r}; an export holds one of {GRAPH_TASKS}"
        )
    for name in (info.graph, "tokenizer.json"):
        if not (folder / name).is_file():
            raise ExampleError(f"{folder / name}: missing (the export is incomplete; export the model again)")
    return info


def load_exported(folder) -> LoadedModel:
    """The LoadedModel of an exported folder: its tokenizer (truncation and padding off, as
    the torch door leaves them), its vocabulary where it has one, the graph (run by
    inference.graph_runner)."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    info = read_export(folder)
    vocab = None
    if (folder / "vocab.txt").is_file():  # finetune.train's WordPiece, as the torch door builds it
        from packed_transformers.data.tokenizer import load_tokenizer

        tokenizer, vocab = load_tokenizer(folder / "vocab.txt")
    else:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer.no_truncation()
        tokenizer.no_padding()
    return LoadedModel(
        spec_of(folder, info.spec), ExportedGraph(folder, info), tokenizer, vocab,
        token_types=info.token_types, max_input_length=info.max_input_length,
    )  # fmt: skip


def exported_problem(info, device: str, dtype: str | None, runtime: str | None) -> str | None:
    """The one line refusing a device, dtype or runtime an exported folder's graph was not
    made for (None: not asked, the folder's own), or None."""
    if device != "cpu":
        return f"an exported folder runs on the CPU ({info.runtime}), not on {device}"
    if runtime not in (None, "auto", info.runtime):
        return f"this folder's graph is for {info.runtime}: --runtime {runtime} needs the model folder it was exported from"
    if dtype not in (None, info.dtype):
        return f"this folder's graph is {info.dtype}: --dtype {dtype} needs `packed export --dtype {dtype}` of the model"
    return None


# the options an exported folder's own graph and door settled (given to a command, refused)
SETTLED_OPTIONS = ("--pooling", "--normalize", "--no-normalize", "--max-length", "--attention-backend", "--compile",
                   "--ray")  # fmt: skip


# the command that runs a graph of each output kind (a command given the other kind refuses it)
COMMAND_OF_OUTPUT = {"embeddings": "embed", "logits": "predict"}


def wrong_command_problem(info: ExportInfo, model, command: str | None) -> str | None:
    """The one line refusing `command` (embed | predict; None: either) on an exported folder
    whose graph gives the other kind of output, or None."""
    if command is None or any(COMMAND_OF_OUTPUT.get(output) == command for output in info.outputs):
        return None
    runs = sorted({COMMAND_OF_OUTPUT[o] for o in info.outputs if o in COMMAND_OF_OUTPUT})
    what = "an embedding model" if "embeddings" in info.outputs else "a classifier"
    return (f"--model {model} is an exported folder of {what} (its graph gives {', '.join(info.outputs)}): "
            f"`packed {' or '.join(runs)}` runs it; `packed {command}` needs "
            f"{'a classifier' if command == 'predict' else 'an embedding model'}")  # fmt: skip


def exported_arguments_problem(args, argv: list[str], command: str | None = None) -> str | None:
    """The one line refusing what a command was asked that an exported folder cannot do (the
    other command's kind of graph; a device, runtime or dtype its graph was not made for;
    options its export settled), or None. Given options only: the parser's defaults mean "as
    the folder says"."""
    given = {word.split("=")[0] for word in argv if word.startswith("--")}
    try:
        info = read_export(args.model)
    except ExampleError as err:
        return str(err)
    wrong = wrong_command_problem(info, args.model, command)
    if wrong:
        return wrong
    settled = [name for name in SETTLED_OPTIONS if name in given]
    if settled:
        return (f"--model {args.model} is an exported folder: {settled[0]} was settled when it was exported "
                "(export the model again with it, or run the model folder)")  # fmt: skip
    return exported_problem(
        info, getattr(args, "device", "cpu"), args.dtype if "--dtype" in given else None,
        args.runtime if "--runtime" in given else None,
    )  # fmt: skip


def settle_exported_arguments(args, argv: list[str], command: str | None = None) -> str | None:
    """A command's arguments for an exported folder: the one line refusing what it cannot do
    (exported_arguments_problem; `command`: embed or predict, None for the server, which runs
    either), else None with args.runtime and args.dtype set to its graph's."""
    problem = exported_arguments_problem(args, argv, command)
    if problem is None:
        info = read_export(args.model)
        args.runtime, args.dtype = info.runtime, info.dtype
    return problem
