"""The one door to a model (model/opening.py): finetune/ and serving/ never decide a stack by
comparing a `model_type`, and every task of every family in the table opens through it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ..conftest import PACKAGE, REPO
from ..house_helpers import PRODUCT_PACKAGES, config_reads, import_circles, import_graph  # noqa: F401


def model_type_comparisons(path) -> list[str]:
    """`x == "bert"`-style comparisons in a file: a Compare whose operands mention model_type,
    or compare with a family name of the door's table."""
    from packed_transformers.model.opening import supported_model_types

    names = set(supported_model_types())
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Compare) or not any(
            isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops
        ):
            continue
        operands = [node.left, *node.comparators]
        text = ast.unparse(node)
        strings = {o.value for o in operands if isinstance(o, ast.Constant) and isinstance(o.value, str)}
        if "model_type" in text or strings & names:
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {text}")
    return found


def test_finetune_and_serving_never_compare_a_model_type():
    """Nor do the door and the families' table: a family is one row of FAMILIES (its choices
    are values), and no `if` names a family."""
    files = sorted((REPO / "packed_transformers" / "finetune").glob("*.py")) + sorted(
        (REPO / "packed_transformers" / "serving").glob("*.py")
    )
    files += [
        REPO / "packed_transformers" / "model" / "opening.py",
        REPO / "packed_transformers" / "model" / "families.py",
    ]
    found = [line for path in files for line in model_type_comparisons(path)]
    assert found == [], "\n".join(found)


def test_the_walker_finds_a_comparison(tmp_path):
    """The check above can fail: a planted comparison is found."""
    planted = REPO / "packed_transformers" / "finetune" / "_planted_for_test.py"
    planted.write_text('def f(config):\n    return config.model_type == "bert"\n')
    try:
        assert model_type_comparisons(planted) == [
            "finetune/_planted_for_test.py:2: config.model_type == 'bert'"
        ]
    finally:
        planted.unlink()


def test_an_unsupported_type_is_one_error_naming_the_list(tmp_path):
    from packed_transformers.model.families import UnsupportedFamily
    from packed_transformers.model.opening import open_model, supported_model_types

    (tmp_path / "config.json").write_text('{"model_type": "opt"}')
    with pytest.raises(UnsupportedFamily) as refused:
        open_model(tmp_path, "classification")
    message = str(refused.value)
    assert "'opt'" in message and ", ".join(supported_model_types()) in message and "\n" not in message
    with pytest.raises(ValueError, match="task 'translation'"):
        open_model(tmp_path, "translation")


def test_bert_opens_on_its_own_stack_and_other_families_on_theirs(tmp_path):
    """The table's one decision, per task: BERT -> the packed BERT heads, a RoBERTa folder ->
    PackedFamilyModel; the head's labels and dropout options reach the model either way."""
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        RobertaConfig,
        RobertaForSequenceClassification,
    )

    from packed_transformers.model.family_model import PackedFamilyModel
    from packed_transformers.model.opening import ModelOptions, open_model

    small = dict(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=40, num_labels=2)  # fmt: skip
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(**small)).save_pretrained(tmp_path / "bert")
    RobertaForSequenceClassification(RobertaConfig(**small, pad_token_id=1)).save_pretrained(
        tmp_path / "roberta"
    )
    options = ModelOptions(new_head=True, dropout={"hidden": 0.0}, config={"num_labels": 3})
    tasks = ("classification", "token_classification", "question_answering", "embedding")
    for task in tasks:
        bert = open_model(tmp_path / "bert", task, options)
        assert type(bert.model).__module__.startswith("packed_transformers.model.") and not isinstance(
            bert.model, PackedFamilyModel
        )
        assert bert.max_tokens == 40
        roberta = open_model(tmp_path / "roberta", task, options)
        assert (
            isinstance(roberta.model, PackedFamilyModel) and roberta.max_tokens == 38
        )  # after padding index 1
    assert open_model(tmp_path / "bert", "classification", options).model.config.num_labels == 3
    assert open_model(tmp_path / "bert", "classification", options).model.config.hidden_dropout_prob == 0.0


def test_finetune_and_serving_have_no_import_circle():
    assert import_circles(import_graph()) == []
    # the check can fail: the circle predict -> ray_job -> ray_shards -> ray_data -> predict
    # that classify_examples once closed is found
    planted = {**import_graph(), "ray_jobs.actors": {"commands.predict"}}
    assert any({"commands.predict", "ray_jobs.actors", "ray_jobs.job"} <= set(group)
               for group in import_circles(planted))  # fmt: skip


def save_decoder_folder(folder: Path, head: str) -> Path:
    import transformers

    from ..decoder_helpers import decoder_tokenizer, tiny_config

    tokenizer = decoder_tokenizer()
    extra = {"num_labels": 3} if head == "classification" else {}
    auto = transformers.AutoModelForSequenceClassification if extra else transformers.AutoModel
    auto.from_config(tiny_config("llama", vocab_size=len(tokenizer), **extra)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", ["bert", "roberta", "llama"])
def test_the_server_reads_a_folders_config_once(tmp_path, family):
    """The way in (serving.engines.load_engine: describe_folder -> open_model -> the family's
    builder -> the tokenizer's input names) reads config.json once and hands it on; the
    embedding door (load_encoder with a pooling) too."""
    from packed_transformers.serving.engines import load_engine

    from ..family_helpers import save_family_folder

    save = save_decoder_folder if family == "llama" else lambda f, task: save_family_folder(f, family, task)
    folder = save(tmp_path / "cls", "classification")
    assert config_reads(lambda: load_engine(folder), folder) == 1
    encoder = save(tmp_path / "enc", "embedding")
    assert config_reads(lambda: load_engine(encoder, pooling="mean"), encoder) == 1
    # the count can fail: a second reader is seen
    from packed_transformers.model.opening import model_type_of

    assert config_reads(lambda: (load_engine(folder), model_type_of(folder)), folder) == 2


def modules_on_the_way_in(open_it) -> list[str]:
    """The repository modules on the call stack when the family's builder is reached
    (PackedFamilyModel.from_pretrained), outermost first, consecutive repeats merged."""
    import traceback
    from unittest import mock

    from packed_transformers.model.family_model import PackedFamilyModel

    seen = []
    real = PackedFamilyModel.from_pretrained.__func__

    def watched(cls, *args, **kwargs):
        frames = [f.filename for f in traceback.extract_stack()]
        inside = [str(Path(f).relative_to(PACKAGE)) for f in frames if f.startswith(str(PACKAGE) + "/")]
        modules = [m for m in inside if m.split("/")[0] in ("serving", "finetune", "model")]
        modules.append("model/families.py")
        seen.extend(m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m)
        return real(cls, *args, **kwargs)

    with mock.patch.object(PackedFamilyModel, "from_pretrained", classmethod(watched)):
        open_it()
    return seen


def test_from_the_servers_command_line_to_the_family_is_five_hops_one_way(tmp_path):
    """serving/cli.py -> serving/engines.py -> door/opener.py -> (door/folder.py or
    inference/embedding.py) -> model/opening.py -> model/families.py: each hop goes down a
    layer or along it (serving, finetune, model), never back up."""
    from packed_transformers.serving.engines import load_engine

    from ..family_helpers import save_family_folder

    layer = {"serving": 0, "finetune": 1, "model": 2}
    folder = save_family_folder(tmp_path / "cls", "roberta", "classification")
    encoder = save_family_folder(tmp_path / "enc", "roberta", "embedding")
    for open_it in (lambda: load_engine(folder), lambda: load_engine(encoder, pooling="mean")):
        path = ["serving/cli.py", *modules_on_the_way_in(open_it)]
        assert len(path) - 1 <= 5, path
        layers = [layer[m.split("/")[0]] for m in path]
        assert layers == sorted(layers) and len(set(path)) == len(path), path


def test_the_door_takes_one_typed_value_per_kind_of_caller(tmp_path):
    """open_folder(folder, how): how is AsTheFolderSays, ForEmbedding or ForTraining, each
    holding only what its kind of caller sets; anything else is refused before any file is read."""
    import dataclasses

    from packed_transformers.door.opener import AsTheFolderSays, ForEmbedding, ForTraining, open_folder

    fields = {
        kind: {f.name for f in dataclasses.fields(kind)}
        for kind in (AsTheFolderSays, ForEmbedding, ForTraining)
    }
    assert fields[ForTraining] == {"task", "model", "config", "label", "tokenizer"}
    assert "normalize" in fields[ForEmbedding] and "normalize" not in fields[AsTheFolderSays]
    with pytest.raises(TypeError, match="not one of"):
        open_folder(tmp_path / "nowhere", "embedding")
