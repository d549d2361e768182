"""An exported folder is untrusted input (door/export_checks.py, issue 108 items 1 and 3).

At 6002aac, 20 of 54 damaged folders ended in a 27-46-line traceback with `.partial` and
`.lock` files left beside the output; another model's tokenizer.json ran with exit 0; a
`graph` of /etc/passwd was opened. Here each damage is made to a copy of a real export and
given to the command that runs it: exit 2, one line naming the damaged file (and the key), and
nothing written where the output would have gone."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from packed_transformers.commands import embed as embed_command
from packed_transformers.commands import export as export_command
from packed_transformers.commands import predict as predict_command

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def exports(checkpoint, trained, tmp_path_factory):
    """A float32 embedding export of `checkpoint` and a classifier export of `trained`."""
    root = tmp_path_factory.mktemp("exports")
    argv = [
        "--model",
        str(checkpoint),
        "--output",
        str(root / "embedder"),
        "--pooling",
        "mean",
        "--normalize",
    ]
    assert export_command.main(argv) == 0
    assert (
        export_command.main(["--model", str(trained / "run" / "model"), "--output", str(root / "classifier")])
        == 0
    )
    return root


def edit_json(folder, change):
    path = folder / "packed_export.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def without(*keys):
    """A change deleting a (nested) key."""

    def change(data):
        *parents, last = keys
        for key in parents:
            data = data[key]
        del data[last]

    return change


def setting(value, *keys):
    def change(data):
        *parents, last = keys
        for key in parents:
            data = data[key]
        data[last] = value

    return change


def unrecorded(data):
    """An export written before sizes and digests were recorded (a folder of an older export)."""
    data.pop("files", None)


def foreign_graph(path):
    """A valid ONNX graph that is not a packed model: sentence-transformers' inputs, one output."""
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("Cast", ["input_ids"], ["last_hidden_state"], to=TensorProto.FLOAT)
    graph = helper.make_graph(
        [node], "other", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "t"]),
                          helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, ["b", "t"])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["b", "t"])],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def damage_folder(folder, damage, other) -> None:
    kind, *how = damage
    if kind == "json":
        for change in how:
            edit_json(folder, change)
    elif kind == "raw-json":
        (folder / "packed_export.json").write_text(how[0])
    elif kind == "link-json":
        real = folder.parent / "elsewhere.json"
        shutil.move(folder / "packed_export.json", real)
        (folder / "packed_export.json").symlink_to(real)
    elif kind == "file":
        name, make = how[0], how[1]
        if len(how) > 2:
            edit_json(folder, how[2])
        path = folder / name
        data = path.read_bytes()
        if make == "half":
            path.write_bytes(data[: len(data) // 2])
        elif make == "empty":
            path.write_bytes(b"")
        elif make == "random":
            path.write_bytes(np.random.default_rng(0).bytes(len(data)))
        elif make == "other":
            shutil.copy(other / name, path)
        elif make == "foreign":
            foreign_graph(path)
        elif make == "garbage":
            path.write_text('{"model": {"type": "Nothing"')


# (what is damaged, the damage, what the one line says beyond the file's name)
EMBEDDER_DAMAGES = [
    ("absurd length", ("json", setting(10**12, "max_input_length")), "max_input_length is 1000000000000"),
    ("NaN dimension", ("json", setting(float("nan"), "dimension")), "dimension is nan"),
    ("bool as a size", ("json", setting(True, "hidden_size")), "hidden_size is true"),
    ("missing nested key", ("json", without("spec", "embedding")), "missing key 'spec.embedding'"),
    ("missing fields", ("json", without("spec", "fields")), "missing key 'spec.fields'"),
    ("fields of a wrong type", ("json", setting([], "spec", "fields")), "spec.fields is []"),
    ("unknown pooling", ("json", setting(["sum"], "spec", "embedding", "pooling")), "spec.embedding.pooling"),
    ("graph outside the folder", ("json", setting("/etc/passwd", "graph")), "graph is \"/etc/passwd\""),
    ("graph up a folder", ("json", setting("../model.onnx", "graph")), "a file name inside the folder"),
    ("outputs of the other task", ("json", setting(["logits"], "outputs")), "spec.task"),
    ("deep JSON", ("raw-json", "[" * 100_000 + "]" * 100_000), "nested too deep"),
    ("not JSON", ("raw-json", "{\"format\": 1,"), "not a readable JSON file"),
    ("linked JSON", ("link-json",), "a symbolic link"),
    ("graph cut short", ("file", "model.onnx", "half"), "when exported (a copy cut short"),
    ("graph emptied", ("file", "model.onnx", "empty"), "when exported (a copy cut short"),
    ("random graph", ("file", "model.onnx", "random"), "not the file this folder was exported with"),
    ("another export's tokenizer", ("file", "tokenizer.json", "other"), "when exported (a copy cut short"),
    ("bad tokenizer, unrecorded", ("file", "tokenizer.json", "garbage", unrecorded), "not a tokenizer"),
    ("random graph, unrecorded", ("file", "model.onnx", "random", unrecorded), "ONNX Runtime cannot load"),
    ("empty graph, unrecorded", ("file", "model.onnx", "empty", unrecorded), "ONNX Runtime cannot load"),
    ("foreign graph, unrecorded", ("file", "model.onnx", "foreign", unrecorded), "not the packed graph"),
    ("dimension unlike the graph", ("json", setting(7, "dimension"), unrecorded), "dimension=7"),
]  # fmt: skip


@pytest.mark.parametrize("name, damage, says", EMBEDDER_DAMAGES, ids=[d[0] for d in EMBEDDER_DAMAGES])
def test_a_damaged_exported_folder_is_one_line_and_nothing_is_written(
    exports, tmp_path, capsys, name, damage, says
):
    folder = tmp_path / "model"
    shutil.copytree(exports / "embedder", folder)
    damage_folder(folder, damage, exports / "classifier")
    source = tmp_path / "texts.jsonl"
    source.write_text("".join(json.dumps({"text": f"text {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "out" / "e.npy"
    out.parent.mkdir()
    capsys.readouterr()
    assert embed_command.main(["--model", str(folder), "--input", str(source), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert says in err and str(folder) in err, err
    assert list(out.parent.iterdir()) == [], "written beside the output"


def test_a_classifier_export_whose_labels_disagree_with_its_graph_is_one_line(exports, tmp_path, capsys):
    folder = tmp_path / "classifier"
    shutil.copytree(exports / "classifier", folder)
    labels = json.loads((folder / "packed_export.json").read_text())["spec"]["labels"]
    edit_json(folder, setting([*labels, "one more"], "spec", "labels"))
    source = tmp_path / "texts.jsonl"
    source.write_text(json.dumps({"text": "a text"}) + "\n")
    out = tmp_path / "p.jsonl"
    assert predict_command.main(["--model", str(folder), "--input", str(source), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"spec.labels names {len(labels) + 1} classes" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["classifier", "texts.jsonl"]


def test_an_export_records_its_files_and_an_intact_copy_runs(exports, tmp_path):
    """The digests are of the folder's own files: a whole copy runs (exit 0) and embeds."""
    info = json.loads((exports / "embedder" / "packed_export.json").read_text())
    assert sorted(info["files"]) == ["model.onnx", "tokenizer.json"]
    assert info["files"]["model.onnx"]["bytes"] == (exports / "embedder" / "model.onnx").stat().st_size
    copy = tmp_path / "copy"
    shutil.copytree(exports / "embedder", copy)
    source = tmp_path / "texts.jsonl"
    source.write_text(json.dumps({"text": "a text"}) + "\n")
    assert (
        embed_command.main(
            ["--model", str(copy), "--input", str(source), "--output", str(tmp_path / "e.npy")]
        )
        == 0
    )
    assert np.load(tmp_path / "e.npy").shape == (1, info["dimension"])
