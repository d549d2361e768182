"""Inference without transformers' modeling code (issue 60, start-up): a BERT folder opened
for inference is a plain torch module (model/inference_head.py) with the trainable head's
outputs, loaded from model.safetensors with load_checked's checks, and a whole predict or
embed run never imports transformers.modeling_utils (whose import brings torch._dynamo,
torch.distributed.tensor, sympy and scipy: seconds of every run's start-up)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from ..conftest import REPO

SMALL = dict(vocab_size=600, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=40, num_labels=3)  # fmt: skip


@pytest.fixture(scope="module")
def classifier_folder(tmp_path_factory):
    """A transformers BertForSequenceClassification folder (save_pretrained: safetensors)."""
    from transformers import BertConfig, BertForSequenceClassification

    folder = tmp_path_factory.mktemp("classifier")
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(**SMALL)).save_pretrained(folder)
    return folder


def rows(seed: int = 0):
    """Two packed rows of 24 tokens: sequences of 9 + 11 and 15 tokens (K = 2)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, SMALL["vocab_size"], (2, 24), generator=generator)
    sequence_ids = torch.zeros(2, 24, dtype=torch.long)
    sequence_ids[0, :9], sequence_ids[0, 9:20], sequence_ids[1, :15] = 1, 2, 1
    position_ids = torch.zeros(2, 24, dtype=torch.long)
    position_ids[0, :9], position_ids[0, 9:20], position_ids[1, :15] = (
        torch.arange(9), torch.arange(11), torch.arange(15),
    )  # fmt: skip
    return dict(
        input_ids=ids * (sequence_ids > 0),
        segment_ids=torch.zeros(2, 24, dtype=torch.long),
        position_ids=position_ids,
        sequence_ids=sequence_ids,
        cls_positions=torch.tensor([[0, 9], [0, 0]]),
        example_index=torch.tensor([[0, 1], [2, -1]]),
    )


HEADS = {  # task -> (transformers class saved, the trainable head, its inference twin, output compared)
    "classification": ("BertForSequenceClassification", "bert_heads.PackedBertForSequenceClassification",
                       "inference_head.SequenceClassifierForInference", "logits"),
    "token_classification": ("BertForTokenClassification", "bert_heads.PackedBertForTokenClassification",
                             "inference_head.TokenClassifierForInference", "logits"),
    "question_answering": ("BertForQuestionAnswering", "bert_heads.PackedBertForQuestionAnswering",
                           "inference_head.QuestionAnsweringForInference", "start_logits"),
}  # fmt: skip


def model_class(dotted: str):
    import importlib

    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(f"packed_transformers.model.{module}"), name)


@pytest.mark.parametrize("task", sorted(HEADS))
def test_each_inference_head_equals_the_trainable_one(task, tmp_path):
    """Same names, same weights, same outputs; opened for inference it is not a
    PreTrainedModel, opened with a new head (fine-tuning) it is the trainable head."""
    import transformers
    from transformers import PreTrainedModel

    from packed_transformers.model.opening import ModelOptions, open_model

    saved, trainable_name, inference_name, output = HEADS[task]
    torch.manual_seed(0)
    labels = 2 if task == "question_answering" else SMALL["num_labels"]  # start, end
    getattr(transformers, saved)(transformers.BertConfig(**{**SMALL, "num_labels": labels})).save_pretrained(
        tmp_path
    )
    trainable = model_class(trainable_name).from_pretrained(tmp_path).eval()
    inference = open_model(tmp_path, task, ModelOptions()).model.eval()
    assert type(inference) is model_class(inference_name) and not isinstance(inference, PreTrainedModel)
    assert type(open_model(tmp_path, task, ModelOptions(new_head=True)).model) is model_class(trainable_name)
    a, b = trainable.state_dict(), inference.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)
    with torch.no_grad():
        assert torch.equal(trainable(**rows())[output], inference(**rows())[output])


def test_the_inference_classifier_refuses_what_load_checked_refuses(classifier_folder, tmp_path):
    """A bare encoder's file (no head), a head of another size, fewer layers in the file
    than config.json names, a truncated file: one ValueError naming the folder each."""
    from packed_transformers.model.inference_head import SequenceClassifierForInference

    state = load_file(classifier_folder / "model.safetensors")
    config = json.loads((classifier_folder / "config.json").read_text())

    def folder_with(name, weights, **changes):
        folder = tmp_path / name
        folder.mkdir()
        save_file(weights, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
        return folder

    bare = {k.removeprefix("bert."): v for k, v in state.items() if k.startswith("bert.")}
    cases = {
        folder_with("bare", bare): "head is not in the file",
        folder_with("labels", state, id2label={str(i): str(i) for i in range(5)}): "weight classifier.bias has shape [3] in the file but [5]",
        folder_with("layers", state, num_hidden_layers=3): "encoder weights of the model are not in the file",
        folder_with("fewer", state, num_hidden_layers=1): "encoder weights in the file are not used",
    }  # fmt: skip
    truncated = folder_with("cut", state)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases[truncated] = "the weights cannot be read"
    for folder, expected in cases.items():
        with pytest.raises(ValueError) as raised:
            SequenceClassifierForInference.from_pretrained(folder)
        assert str(folder) in str(raised.value) and expected in str(raised.value), (folder.name, raised.value)


def test_legacy_names_and_pickle_files_go_through_transformers(classifier_folder, tmp_path):
    """LayerNorm.gamma / .beta (old TF-converted files) are renamed by transformers' loader;
    a folder without model.safetensors is read by it too: the same weights either way."""
    from packed_transformers.model.inference_head import SequenceClassifierForInference

    reference = SequenceClassifierForInference.from_pretrained(classifier_folder).state_dict()
    state = load_file(classifier_folder / "model.safetensors")
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in state.items()}  # fmt: skip
    save_file(renamed, legacy / "model.safetensors")
    (legacy / "config.json").write_text((classifier_folder / "config.json").read_text())
    loaded = SequenceClassifierForInference.from_pretrained(legacy).state_dict()
    assert all(torch.equal(loaded[n], reference[n]) for n in reference)


# What transformers' modeling_utils brings in at import (seconds of start-up): none of it may
# be loaded by a command that only runs a BERT folder.
HEAVY_MODULES = [
    "transformers.modeling_utils",
    "torch._dynamo",
    "torch.distributed.tensor",
    "sympy",
    "scipy.optimize",
]


def heavy_modules_after(script: str, *arguments: str) -> list[str]:
    """Run `script` in a fresh interpreter; -> the HEAVY_MODULES it had imported at its end."""
    script += f"\nimport sys\nprint('LOADED', [m for m in {HEAVY_MODULES!r} if m in sys.modules])\n"
    out = subprocess.run([sys.executable, "-c", script, *arguments], cwd=REPO, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.rsplit("LOADED ", 1)[1].replace("'", '"'))


@pytest.mark.slow  # whole commands in fresh interpreters, ~12 s
def test_predict_and_embed_never_import_transformers_modeling_code(classifier_folder, tmp_path):
    """Whole runs, in a fresh interpreter: commands.predict on a BERT classifier folder and on a
    token classifier's, commands.embed on a sentence-transformers BERT folder; then the modules
    loaded. (Question answering's inference head is opened by the same table; its predict run
    needs SQuAD-shaped input and is not run here.)"""
    from transformers import BertConfig, BertForTokenClassification

    from packed_transformers.data.assets import model_dir

    from ..family_helpers import family_tokenizer

    family_tokenizer("bert").save_pretrained(classifier_folder)
    tagger = tmp_path / "tagger"
    BertForTokenClassification(BertConfig(**SMALL)).save_pretrained(tagger)
    family_tokenizer("bert").save_pretrained(tagger)
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a b c", "d e", "a c e b d a"]))
    script = (
        "import runpy, sys\n"
        "sys.argv = sys.argv[1:]\n"
        "try:\n    runpy.run_module(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as end:\n    assert not end.code, end.code\n"
    )
    runs = [
        (
            "packed_transformers.finetune.predict",
            ["--model", str(classifier_folder), "--output", str(tmp_path / "p.jsonl")],
        ),
        (
            "packed_transformers.finetune.predict",
            ["--model", str(tagger), "--output", str(tmp_path / "t.jsonl")],
        ),
        (
            "packed_transformers.finetune.embed",
            ["--model", str(model_dir()), "--output", str(tmp_path / "e.npy")],
        ),
    ]
    for module, arguments in runs:
        assert heavy_modules_after(script, module, "--input", str(texts), "--quiet", *arguments) == [], module


@pytest.mark.slow
def test_the_server_loads_a_bert_folder_without_transformers_modeling_code(classifier_folder):
    """`python -m packed_transformers.serving`'s modules and its engine for a BERT classifier folder, in a fresh
    interpreter: none of the heavy modules is imported."""
    from ..family_helpers import family_tokenizer

    family_tokenizer("bert").save_pretrained(classifier_folder)
    script = (
        "from pathlib import Path\nimport packed_transformers.serving.cli, packed_transformers.serving.app\n"
        "from packed_transformers.serving.engines import load_engine\n"
        f"load_engine(Path({str(classifier_folder)!r}))"
    )
    assert heavy_modules_after(script) == []


@pytest.mark.slow
def test_the_whole_process_bench_compares_predict_with_the_loop_and_bf16(classifier_folder, tmp_path):
    """bench/bench_predict_process.py --bf16 on a tiny folder, one round: the three processes
    ran, the scores agree, and bf16 is measured or (a CPU without bf16) reported in one line."""
    from ..family_helpers import family_tokenizer

    family_tokenizer("bert").save_pretrained(classifier_folder)
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": " ".join("abcde"[: 1 + i % 5])}) + "\n" for i in range(20)))
    out = subprocess.run(
        [sys.executable, "bench/bench_predict_process.py", "--model", str(classifier_folder), "--input", str(texts),
         "--rounds", "1", "--bf16", "--output", str(tmp_path / "result.json")],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["texts"] == 20 and result["max_score_difference"] < 1e-5
    assert set(result["median_seconds"]) >= {
        "packed_transformers.finetune.predict",
        "sorted transformers loop",
    }
    if "bf16" in result:
        assert result["bf16"].startswith("not measured: ")
    else:
        assert result["bf16_over_fp32_median"] > 0 and result["bf16_max_score_difference"] < 0.05
