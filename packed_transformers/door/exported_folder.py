"""A folder `packed export` wrote, opened without torch or transformers: the packed graph,
the tokenizer and what the read-out needs, into the LoadedModel every command runs.

    DIR/packed_export.json   what the folder holds (ExportInfo; format EXPORT_FORMAT)
    DIR/model.onnx           the packed model: rows in, per-slot vectors or scores out (ONNX Runtime)
    DIR/model.xml, model.bin the same as an OpenVINO IR (`packed export --runtime openvino`)
    DIR/tokenizer.json       the source folder's tokenizer (`tokenizers`), as it cut and templated texts
    DIR/vocab.txt            only for a finetune.train WordPiece folder (its pairs' rule)

    info = read_export(folder)              # ExampleError (one line) for anything else
    loaded = load_exported(folder)          # LoadedModel; loaded.model is an ExportedGraph

Both check the folder as untrusted input first (door.export_checks: every key's type and range,
the graph confined to the folder, each file a plain file of its recorded size; load_exported
also its recorded sha256 and the tokenizer parsed; inference.exported_backend.opened_graph the
graph as its runtime loads it).

Everything the torch door decides once when it opens a folder (the task, labels, the length
limit, pooling, normalisation, prompts, lower-casing, token types) was decided by it when the
folder was exported, and is read back here as it was: the exported process cuts, packs and
reads out texts exactly as the torch process does (tests/inference/test_exported.py holds the
two equal). Imports: the standard library, numpy, `tokenizers`, and onnxruntime or openvino when
the graph is run (inference.onnx_session, inference.openvino_session); never torch or
transformers (tests assert it on sys.modules).
"""

from __future__ import annotations

import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packed_transformers.common.choices import EXPORTED
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.door.folder_spec import EmbeddingSpec, FolderSpec, TextFields
from packed_transformers.door.loaded import LoadedModel

EXPORT_FORMAT = 1


@dataclass(frozen=True)
class ExportInfo:
    """packed_export.json: the graph and how texts reach it.

    runtime, dtype: what the graph is for ("onnxruntime": "float32" | "int8"; "openvino":
    "float32" | "bfloat16" | "int8"); graph: its file (model.onnx; model.xml, its weights in model.bin);
    outputs: the graph's outputs ("embeddings" [rows, K, D] | "logits" [rows, K, C]);
    dimension: D (embedding) or C (classification); hidden_size: the model's H (the packing's
    cost model reads it); parameters: the model's count (the server's cold speed estimate); max_input_length: tokens per text, specials included; token_types:
    whether the tokenizer's token types reach the model; spec: the source FolderSpec's fields
    (path left out); source: the folder exported and its fingerprint (common.files); files:
    {name: {bytes, sha256}} of the graph, tokenizer.json and vocab.txt as exported ({} in a
    folder exported before they were recorded: checked by its keys alone)."""

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
    files: dict = field(default_factory=dict)

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
    """packed_export.json of `folder`, checked with the files it names (door.export_checks, sizes
    but not digests); ExampleError naming the file and key."""
    from packed_transformers.door.export_checks import check_export_fields, check_file_sizes, read_export_json

    folder = Path(folder)
    path = folder / EXPORTED
    data = read_export_json(path)
    if data.get("format") != EXPORT_FORMAT:
        raise ExampleError(
            f"{path}: format {data.get('format')!r}; this version reads format {EXPORT_FORMAT} (export the model again)"
        )
    required = [name for name, f in ExportInfo.__dataclass_fields__.items() if name != "files"]
    missing = [name for name in required if name not in data]
    if missing:
        raise ExampleError(f"{path}: missing key {missing[0]!r}")
    check_export_fields(path, data)
    check_file_sizes(folder, data)
    info = ExportInfo(**{name: data[name] for name in required}, files=data.get("files", {}))
    return ExportInfo(**{**asdict(info), "outputs": tuple(info.outputs)})


def load_exported(folder) -> LoadedModel:
    """The LoadedModel of an exported folder: its tokenizer (truncation and padding off, as
    the torch door leaves them), its vocabulary where it has one, the graph (run by
    inference.exported_backend, which checks it when it opens it)."""
    from tokenizers import Tokenizer

    from packed_transformers.door.export_checks import check_file_digests

    folder = Path(folder)
    info = read_export(folder)
    check_file_digests(folder, info.to_json())
    vocab = None
    try:
        if (folder / "vocab.txt").is_file():  # finetune.train's WordPiece, as the torch door builds it
            from packed_transformers.data.tokenizer import load_tokenizer

            tokenizer, vocab = load_tokenizer(folder / "vocab.txt")
        else:
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
            tokenizer.no_truncation()
            tokenizer.no_padding()
    except ExampleError:
        raise
    except Exception as err:  # the tokenizers library's parse errors carry no type of their own
        name = "vocab.txt" if (folder / "vocab.txt").is_file() else "tokenizer.json"
        reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise ExampleError(f"{folder / name}: not a tokenizer this folder can use ({reason})") from None
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
        from packed_transformers.door.export_checks import EXPORT_DTYPES, EXPORT_DTYPES_OF

        if dtype in EXPORT_DTYPES:
            runtime = info.runtime if dtype in EXPORT_DTYPES_OF[info.runtime] else next(
                name for name, dtypes in EXPORT_DTYPES_OF.items() if dtype in dtypes
            )  # fmt: skip
            return (f"this folder's graph is {info.dtype}: --dtype {dtype} needs `packed export --runtime {runtime} "
                    f"--dtype {dtype}` of the model")  # fmt: skip
        # advice a user can follow: export writes only EXPORT_DTYPES; torch runs the others
        return (f"this folder's graph is {info.dtype}; exports are {' or '.join(EXPORT_DTYPES)}: --dtype {dtype} "
                f"runs on the model folder it was exported from ({info.source.get('folder', 'its source.folder')})")  # fmt: skip
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


def exported_arguments_problem(
    info: ExportInfo, args, argv: list[str], command: str | None = None
) -> str | None:
    """The one line refusing what a command was asked that an exported folder (`info`, its
    packed_export.json) cannot do (the other command's kind of graph; a device, runtime or
    dtype its graph was not made for; options its export settled), or None. Given options
    only: the parser's defaults mean "as the folder says"."""
    given = {word.split("=")[0] for word in argv if word.startswith("--")}
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
    try:
        info = read_export(args.model)  # once: it checks the folder's files too
    except ExampleError as err:
        return str(err)
    problem = exported_arguments_problem(info, args, argv, command)
    if problem is None:
        args.runtime, args.dtype = info.runtime, info.dtype
    return problem
