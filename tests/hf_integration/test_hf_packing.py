"""Packing for Hugging Face users (hf_integration.trainer, hf_integration.pipeline): `datasets` in, a real
transformers `Trainer` and pipeline-style inference out, judged by the stock transformers
classes run unpacked on the same examples."""

import glob
import json
import re

import numpy as np
import pytest
import torch
from datasets import Dataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
)

from packed_transformers.data import assets
from packed_transformers.data.qa_windows import fast_tokenizer
from packed_transformers.data.tokenizer import load_tokenizer
from packed_transformers.hf_integration.pipeline import packed_pipeline
from packed_transformers.hf_integration.trainer import (
    PackedDataCollator,
    PackedDatasetError,
    pack_dataset,
    unpack_predictions,
)
from packed_transformers.model.bert_heads import (
    PackedBertForQuestionAnswering,
    PackedBertForSequenceClassification,
    PackedBertForTokenClassification,
)
from packed_transformers.packs.rows import pack_rows
from packed_transformers.packs.tokenized import pack_examples

from ..hf_helpers import (
    accuracy,  # noqa: F401
    trainer_for,  # noqa: F401
)
from ..model_helpers import BACKENDS

CLASSES = ["business", "entertainment", "politics", "sport", "tech"]


@pytest.fixture(scope="module")
def tokenizer():
    return fast_tokenizer(load_tokenizer(assets.vocab_file())[1])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    """A tiny random BERT over the real vocabulary, no dropout, with its tokenizer files."""
    folder = tmp_path_factory.mktemp("tiny_bert")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bbc(tokenizer):
    """BBC News titles + first lines, labelled by topic, tokenized without padding."""
    files = sorted(glob.glob(assets.corpus_glob()))[::9]
    texts, labels = [], []
    for path in files:
        lines = [line.strip() for line in open(path, encoding="utf-8", errors="replace") if line.strip()]
        texts.append(lines[0] + " " + lines[1][:200])
        labels.append(CLASSES.index(path.split("/")[-2]) if path.split("/")[-2] in CLASSES else 3)
    data = Dataset.from_dict({"text": texts, "label": labels})
    return data.map(lambda b: tokenizer(b["text"], truncation=True, max_length=64), batched=True)


def stock_logits_and_losses(folder, data):
    """Each example alone through transformers' BertForSequenceClassification."""
    stock = BertForSequenceClassification.from_pretrained(folder).eval()
    logits, losses = [], []
    with torch.no_grad():
        for ids, types, label in zip(data["input_ids"], data["token_type_ids"], data["label"]):
            out = stock(
                input_ids=torch.tensor([ids]),
                token_type_ids=torch.tensor([types]),
                labels=torch.tensor([label]),
            )
            logits.append(out.logits[0].numpy())
            losses.append(float(out.loss))
    return np.stack(logits), np.array(losses)


pytestmark = pytest.mark.slow


def test_trainer_trains_evaluates_predicts_and_saves_a_stock_folder(checkpoint, bbc, tmp_path):
    train, held_out = bbc.select(range(0, 200)), bbc.select(range(200, len(bbc)))
    packed = pack_dataset(train, "single_label_classification", 128, 6, num_labels=5, verbose=False)
    packed_eval = pack_dataset(held_out, "single_label_classification", 128, 6, num_labels=5, verbose=False)
    assert len(packed) < len(train) / 2  # really packed
    model = PackedBertForSequenceClassification.from_pretrained(checkpoint, num_labels=5, new_head=True)
    trainer = trainer_for(model, tmp_path / "run", packed, packed_eval)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < losses[0]

    out = tmp_path / "saved"
    trainer.save_model(str(out))
    logits, per_example = stock_logits_and_losses(out, held_out)
    metrics = trainer.evaluate()
    # eval_loss: the mean over examples of the stock model's own loss, not a mean per batch.
    assert metrics["eval_loss"] == pytest.approx(per_example.mean(), abs=1e-5)
    assert metrics["eval_accuracy"] == pytest.approx(
        float((logits.argmax(-1) == np.array(held_out["label"])).mean())
    )

    prediction = trainer.predict(packed_eval)
    rows = unpack_predictions("single_label_classification", prediction.predictions, prediction.label_ids)
    np.testing.assert_allclose(rows.predictions, logits, atol=1e-5, rtol=0)  # input order
    np.testing.assert_array_equal(rows.labels, held_out["label"])


def test_gradient_accumulation_and_resume_give_the_same_weights(checkpoint, bbc, tmp_path):
    """Trainer's num_items_in_batch reaches the model: 2 micro-batches of 4 packs make the
    step of one batch of 8; and a run resumed from its checkpoint ends where an
    uninterrupted one does."""
    packed = pack_dataset(
        bbc.select(range(160)), "single_label_classification", 128, 6, num_labels=5, verbose=False
    )

    def fresh_model():
        torch.manual_seed(0)  # the classifier's initialisation
        return PackedBertForSequenceClassification.from_pretrained(checkpoint, num_labels=5, new_head=True)

    def final_weights(folder, **arguments):
        model = fresh_model()
        # Plain SGD without clipping: the update is proportional to the gradient, so a loss
        # normalised over the wrong count shows (Adam and clipping would hide a scale).
        trainer = trainer_for(model, folder, packed, optim="sgd", max_grad_norm=0.0, **arguments)
        trainer.train()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    one = final_weights(tmp_path / "a", max_steps=3, per_device_train_batch_size=8, learning_rate=1e-2)
    two = final_weights(
        tmp_path / "b",
        max_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
    )
    for name in one:
        torch.testing.assert_close(one[name], two[name], atol=2e-6, rtol=1e-5, msg=name)

    final_weights(tmp_path / "c", max_steps=3, save_strategy="steps", save_steps=2, learning_rate=1e-2)
    model = fresh_model()
    trainer = trainer_for(
        model, tmp_path / "c", packed, max_steps=3, learning_rate=1e-2, optim="sgd", max_grad_norm=0.0
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "c" / "checkpoint-2"))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, one[name], atol=2e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_classification_equals_transformers_per_example(backend, tmp_path):
    """Packed NER head vs BertForTokenClassification, each sentence alone: logits, loss and
    gradients (fp32, real MiniLM weights, -100 labels ignored)."""
    torch.manual_seed(0)
    stock = BertForTokenClassification.from_pretrained(assets.model_dir(), num_labels=7).eval()
    stock.save_pretrained(tmp_path)
    ours = PackedBertForTokenClassification.from_pretrained(tmp_path, attention_backend=backend).eval()
    rng = np.random.default_rng(0)
    tokens = [
        np.concatenate([[101], rng.integers(2000, 9000, size=n), [102]]) for n in rng.integers(3, 30, size=9)
    ]
    labels = [np.where(rng.random(len(t)) < 0.2, -100, rng.integers(0, 7, size=len(t))) for t in tokens]
    for label in labels:
        label[0] = label[-1] = -100
    lengths = np.array([len(t) for t in tokens])
    table = pack_examples(lengths, 64, 3, "lpfhp", seed=0)
    rows = pack_rows(tokens, table, 64)
    packed_labels = np.full((len(table), 64), -100)
    for pack, slots in enumerate(table):
        for slot, example in enumerate(slots):
            if example >= 0:
                first = rows["cls_positions"][pack, slot]
                packed_labels[pack, first : first + lengths[example]] = labels[example]
    batch = {k: torch.from_numpy(v) for k, v in rows.items()}
    with torch.set_grad_enabled(backend != "flex"):
        out = ours(**batch, labels=torch.from_numpy(packed_labels))
    sums, count = [], 0
    for pack, slots in enumerate(table):
        for slot, example in enumerate(slots):
            if example < 0:
                continue
            first = rows["cls_positions"][pack, slot]
            theirs = stock(
                input_ids=torch.from_numpy(tokens[example])[None],
                labels=torch.from_numpy(labels[example])[None],
            )
            got = out["logits"][pack, first : first + lengths[example]].detach().numpy()
            np.testing.assert_allclose(got, theirs.logits[0].detach().numpy(), atol=1e-5, rtol=0)
            labelled = int((labels[example] != -100).sum())
            sums.append(theirs.loss * labelled)
            count += labelled
    hf_loss = torch.stack(sums).sum() / count
    assert float(out["loss"].detach()) == pytest.approx(float(hf_loss.detach()), abs=1e-5)
    if backend == "flex":  # no CPU backward in torch
        return
    out["loss"].backward()
    hf_loss.backward()
    reference = dict(stock.named_parameters())
    for name, parameter in ours.named_parameters():
        expected = reference[name].grad
        assert float((parameter.grad - expected).abs().max()) <= 1e-5 * max(
            float(expected.abs().max()), 1.0
        ), name


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30), multi=st.booleans())
def test_classification_pipeline_keeps_input_order(lengths, multi, checkpoint_with_head):
    folder = checkpoint_with_head[multi]
    words = "market film vote goal phone bank star party team chip".split()
    texts = [" ".join(words[(i + j) % len(words)] for j in range(n)) for i, n in enumerate(lengths)]
    predict = packed_pipeline(
        "text-classification", model=folder, batch_size=8, max_sequences_per_pack=4, top_k=None
    )
    got = predict(texts)
    stock = BertForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        for text, ranked in zip(texts, got):
            logits = stock(**tokenizer(text, return_tensors="pt")).logits[0].numpy()
            scores = 1 / (1 + np.exp(-logits)) if multi else np.exp(logits) / np.exp(logits).sum()
            assert {r["label"]: r["score"] for r in ranked} == pytest.approx(
                {stock.config.id2label[c]: float(scores[c]) for c in range(len(scores))}, abs=1e-5
            )


@pytest.fixture(scope="module")
def checkpoint_with_head(tmp_path_factory, checkpoint):
    """{multi_label: folder} of fine-tuning-shaped classifiers saved by our model."""
    out = {}
    for multi in (False, True):
        torch.manual_seed(1)
        model = PackedBertForSequenceClassification.from_pretrained(
            checkpoint,
            new_head=True,
            num_labels=3,
            problem_type="multi_label_classification" if multi else None,
            id2label={0: "a", 1: "b", 2: "c"},
            label2id={"a": 0, "b": 1, "c": 2},
        )
        folder = tmp_path_factory.mktemp(f"head_{multi}")
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(checkpoint).save_pretrained(folder)
        out[multi] = folder
    return out


def test_token_classification_pipeline_equals_transformers_pipeline(checkpoint, tmp_path):
    from transformers import pipeline

    torch.manual_seed(2)
    names = {0: "O", 1: "B-ORG", 2: "I-ORG"}
    model = PackedBertForTokenClassification.from_pretrained(
        checkpoint, new_head=True, num_labels=3, id2label=names, label2id={v: k for k, v in names.items()}
    )
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(tmp_path)
    texts = ["Time Warner profits jumped at the firm", "Google bought shares", "a b c d e f g h i j k l m n"]
    ours = packed_pipeline("token-classification", model=tmp_path)(texts)
    theirs = pipeline("token-classification", model=str(tmp_path), device="cpu")(texts)
    for mine, stock in zip(ours, theirs):
        assert [(e["entity"], e["index"], e["word"], e["start"], e["end"]) for e in mine] == [
            (e["entity"], e["index"], e["word"], e["start"], e["end"]) for e in stock
        ]
        np.testing.assert_allclose([e["score"] for e in mine], [e["score"] for e in stock], atol=1e-5)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.remove_columns(["input_ids"]), "no column 'input_ids'"),
        (lambda d: d.map(lambda r, i: {"label": 9 if i == 3 else r["label"]}, with_indices=True), "column 'label', row 3: label 9"),
        (lambda d: d.map(lambda r, i: {"input_ids": r["input_ids"] * 10 if i == 2 else r["input_ids"]}, with_indices=True), "column 'input_ids', row 2"),
    ],
)  # fmt: skip
def test_bad_datasets_are_refused_naming_column_and_row(bbc, change, message):
    data = change(bbc.select(range(10)))
    if "attention_mask" in data.column_names:
        data = data.remove_columns(["attention_mask"])
    with pytest.raises(PackedDatasetError, match=message):
        pack_dataset(data, "single_label_classification", 128, num_labels=5, verbose=False)


def test_question_answering_pipeline_answers_as_predict(tmp_path, checkpoint):
    """The QA pipeline's answers are commands.predict's on the same folder and questions."""
    from packed_transformers.commands import predict
    from packed_transformers.data.qa_cloze import build, official_layout

    torch.manual_seed(3)
    model = PackedBertForQuestionAnswering.from_pretrained(checkpoint, new_head=True)
    folder = tmp_path / "qa"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(folder)
    (folder / "vocab.txt").write_text(assets.vocab_file().read_text())
    (folder / "finetune.json").write_text(
        json.dumps(
            {
                "task": "question_answering",
                "max_sequence_length": 96,
                "qa": {
                    "doc_stride": 32,
                    "n_best_size": 20,
                    "max_answer_length": 30,
                    "version_2_with_negative": False,
                    "null_score_diff_threshold": 0.0,
                },
            }
        )  # fmt: skip
    )
    from pathlib import Path

    files = [Path(f) for f in sorted(glob.glob(assets.corpus_glob()))[::60]]
    _, dev, _ = build(files, seed=4, per_article=2, dev_fraction=0.5)
    (tmp_path / "dev.json").write_text(json.dumps(official_layout(dev)))
    assert (
        predict.main(
            [
                "--model",
                str(folder),
                "--input",
                str(tmp_path / "dev.json"),
                "--output",
                str(tmp_path / "p.json"),
            ]
        )
        == 0
    )
    expected = json.loads((tmp_path / "p.json").read_text())
    answer = packed_pipeline("question-answering", model=folder, max_length=96, doc_stride=32)
    got = answer([{"question": q["question"], "context": q["context"]} for q in dev])
    assert [g["answer"] for g in got] == [expected[q["id"]] for q in dev]
    for g, q in zip(got, dev):
        assert q["context"][g["start"] : g["end"]] == g["answer"]


def test_pipelines_refuse_bad_texts_naming_the_input_and_take_empty_batches(checkpoint):
    """What transformers' pipelines answer with a TypeError from the tokenizer (a lone
    surrogate, None) is a ValueError naming the input; an empty batch is an empty answer.
    (The bare MiniLM folder has no heads, which a folder given to a pipeline must have: the
    models are given with new heads here.)"""
    heads = {
        "text-classification": PackedBertForSequenceClassification.from_pretrained(checkpoint, new_head=True),
        "token-classification": PackedBertForTokenClassification.from_pretrained(checkpoint, new_head=True),
        "question-answering": PackedBertForQuestionAnswering.from_pretrained(checkpoint, new_head=True),
    }
    classify, tag, answer = (
        packed_pipeline(task, model=model.eval(), tokenizer=checkpoint) for task, model in heads.items()
    )
    for run, bad, says in [
        (classify, ["fine", "\ud800x"], "input 1: the text: not valid Unicode (a lone surrogate U+D800"),
        (classify, ["fine", None], "input 1: the text must be a string, got None"),
        (classify, [("fine", "\udfff")], "input 0: the text pair: not valid Unicode"),
        (tag, ["\ud800"], "input 0: the text: not valid Unicode"),
        (answer, [{"question": "who?", "context": "\ud800 x"}], "input 0: the context: not valid Unicode"),
        (answer, [{"question": "who?", "context": "a b"}, {"question": "who?", "context": " "}], "input 1: the context is empty"),
        (answer, [{"question": "who?"}], 'input 0: expected {"question": ..., "context": ...}'),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(says)):
            run(bad)
    assert classify([]) == [] and tag([]) == [] and answer([]) == []


def test_a_folder_opened_for_another_task_is_refused_naming_both(checkpoint_with_head):
    """packed_pipeline opens a folder through the door predict and the server use (LoadedModel):
    a classification folder asked to answer questions is one ValueError, not a random head."""
    with pytest.raises(
        ValueError, match=r"a classification model; task 'question-answering' needs a question_answering"
    ):
        packed_pipeline("question-answering", model=checkpoint_with_head[False])


def test_the_collator_fills_a_short_batch_with_empty_packs_only_where_asked(checkpoint, bbc):
    packed = pack_dataset(
        bbc.select(range(40)), "single_label_classification", 128, 6, num_labels=5, verbose=False
    )
    features = [packed[i] for i in range(3)]
    as_is = PackedDataCollator()(features)
    filled = PackedDataCollator(packs_per_batch=5)(features)
    for name, values in as_is.items():
        assert filled[name].shape == (5, *values.shape[1:]), name
        torch.testing.assert_close(filled[name][:3], values, msg=name)
    assert (filled["example_index"][3:] == -1).all() and (filled["labels"][3:] == -100).all()
    assert (filled["input_ids"][3:] == 0).all() and (filled["sequence_ids"][3:] == 0).all()
    # a batch at or above the size is stacked as it is
    assert PackedDataCollator(packs_per_batch=2)(features)["input_ids"].shape[0] == 3
    for bad in (0, -1, 2.0, True, "8"):
        with pytest.raises(PackedDatasetError, match="packs_per_batch"):
            PackedDataCollator(packs_per_batch=bad)


def test_trainer_torch_compile_builds_one_graph_for_a_run_whose_last_batch_is_short(
    checkpoint, bbc, tmp_path
):
    """Trainer(torch_compile=True) as a user sets it (its aot_eager backend: inductor's capture
    and forward/backward split without the C++ build). The packs do not divide into batches
    of 8, so the epoch's last batch is short: stacked as it is, dynamo compiles a second graph
    for it; filled with empty packs, the run is one graph, and trains exactly as eager."""
    packed = pack_dataset(
        bbc.select(range(160)), "single_label_classification", 128, 6, num_labels=5, verbose=False
    )
    assert len(packed) % 8, "the test needs a short last batch"

    def run(folder, compiled: bool, collator):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)  # the classifier's initialisation
        model = PackedBertForSequenceClassification.from_pretrained(checkpoint, num_labels=5, new_head=True)
        options = dict(torch_compile=True, torch_compile_backend="aot_eager") if compiled else {}
        trainer = trainer_for(
            model, folder, packed, max_steps=-1, num_train_epochs=1, logging_steps=1, **options
        )
        trainer.data_collator = collator
        trainer.train()
        counters = torch._dynamo.utils.counters
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        torch._dynamo.reset()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, graphs, breaks

    eager_losses, eager_weights, _, _ = run(tmp_path / "eager", False, PackedDataCollator())
    losses, weights, graphs, breaks = run(tmp_path / "filled", True, PackedDataCollator(packs_per_batch=8))
    assert (graphs, breaks) == (1, 0)
    assert len(losses) == len(eager_losses) == -(-len(packed) // 8)
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-6, atol=1e-6)
    for name in eager_weights:
        torch.testing.assert_close(weights[name], eager_weights[name], rtol=1e-5, atol=1e-6, msg=name)
    _, _, graphs, _ = run(tmp_path / "short", True, PackedDataCollator())
    assert graphs == 2  # the short batch's own graph: what the filling avoids
