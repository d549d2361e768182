"""The other encoder families under transformers' own `Trainer`: `pack_dataset` over the
family's tokenizer, `PackedFamilyModel` as the model, every head. Judged by the folder
Trainer saves, loaded in transformers' Auto class and run on each example alone: the
packed evaluation loss is its mean per-example loss, the packed predictions its logits;
gradient accumulation and resume from a checkpoint end on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from datasets import Dataset
from transformers import AutoTokenizer

from packed_transformers.hf_integration.trainer import pack_dataset, packed_metrics, unpack_predictions
from packed_transformers.model.family_model import PackedFamilyModel

from ..family_helpers import AUTO, SENTENCES, save_family_folder
from ..hf_helpers import trainer_for as packed_trainer

pytestmark = pytest.mark.slow

TEXTS = [s for s in SENTENCES if 3 < len(s.split()) < 40][:48]
KIND = {  # pack_dataset's task -> the family model's head
    "single_label_classification": "classification",
    "multi_label_classification": "classification",
    "token_classification": "token_classification",
    "question_answering": "question_answering",
}
# Every family besides BERT (whose packed heads test_hf_packing runs), each head at least twice.
CASES = [
    ("roberta", "single_label_classification"),
    ("mpnet", "single_label_classification"),
    ("nomic_bert", "single_label_classification"),
    ("xlm-roberta", "multi_label_classification"),
    ("modernbert", "token_classification"),
    ("distilbert", "token_classification"),
    ("camembert", "token_classification"),
    ("deberta-v2", "question_answering"),
    ("electra", "question_answering"),
]


def labelled_dataset(folder, task: str, seed: int = 0) -> Dataset:
    """TEXTS tokenized by the folder's own tokenizer (no padding), with random labels of
    the task: a class, 3 multi-hot numbers, a label per token (-100 on special tokens),
    or an answer span inside a (question, context) window."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rng = np.random.default_rng(seed)
    if task == "question_answering":
        encoded = tokenizer([t.split()[0] + " ?" for t in TEXTS], TEXTS, truncation=True, max_length=64)
    else:
        encoded = tokenizer(TEXTS, truncation=True, max_length=64)
    columns = {name: encoded[name] for name in encoded if name != "attention_mask"}
    lengths = [len(ids) for ids in columns["input_ids"]]
    if task == "single_label_classification":
        columns["label"] = rng.integers(0, 3, len(TEXTS)).tolist()
    elif task == "multi_label_classification":
        columns["label"] = rng.integers(0, 2, (len(TEXTS), 3)).astype(float).tolist()
    elif task == "token_classification":
        columns["label"] = [[-100, *rng.integers(0, 3, n - 2).tolist(), -100] for n in lengths]
    else:
        starts = [int(rng.integers(0, n - 1)) for n in lengths]
        columns["start_positions"] = starts
        columns["end_positions"] = [
            int(rng.integers(s, min(s + 4, n - 1) + 1)) for s, n in zip(starts, lengths)
        ]
    return Dataset.from_dict(columns)


def stock_outputs(folder, task: str, data: Dataset):
    """Each example alone through transformers' Auto class: its outputs and its own loss
    (token classification: the losses of its labelled tokens)."""
    stock = getattr(transformers, AUTO[KIND[task]]).from_pretrained(folder).eval()
    outputs, losses = [], []
    with torch.no_grad():
        for row in data:
            arguments = {"input_ids": torch.tensor([row["input_ids"]])}
            if "token_type_ids" in row:
                arguments["token_type_ids"] = torch.tensor([row["token_type_ids"]])
            out = stock(**arguments)
            if task == "question_answering":
                start, end = out.start_logits[0], out.end_logits[0]
                outputs.append((start.numpy(), end.numpy()))
                loss = (
                    torch.nn.functional.cross_entropy(start[None], torch.tensor([row["start_positions"]]))
                    + torch.nn.functional.cross_entropy(end[None], torch.tensor([row["end_positions"]]))
                ) / 2
                losses.append(float(loss))
                continue
            logits = out.logits[0]
            outputs.append(logits.numpy())
            label = torch.tensor(row["label"])
            if task == "single_label_classification":
                losses.append(float(torch.nn.functional.cross_entropy(logits[None], label[None])))
            elif task == "multi_label_classification":
                losses.append(
                    float(torch.nn.functional.binary_cross_entropy_with_logits(logits, label.float()))
                )
            else:
                kept = label != -100
                losses.extend(
                    torch.nn.functional.cross_entropy(logits[kept], label[kept], reduction="none").tolist()
                )
    return outputs, np.array(losses)


def trainer_for(model, output_dir, task: str, train, evaluation=None, **arguments):
    """test_hf_packing's Trainer, at this file's scale, scoring `task`."""
    small = {
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "max_steps": 4,
        "logging_steps": 1,
    }
    return packed_trainer(
        model, output_dir, train, evaluation, packed_metrics(task), **{**small, **arguments}
    )


@pytest.mark.parametrize("family, task", CASES)
def test_trainer_trains_a_family_and_its_saved_folder_equals_the_packed_evaluation(tmp_path, family, task):
    extra = {"problem_type": task} if task == "multi_label_classification" else {}
    folder = save_family_folder(tmp_path / "start", family, KIND[task], **extra)
    data = labelled_dataset(folder, task)
    packed = pack_dataset(
        data, task, 128, 4, num_labels=None if task == "question_answering" else 3, verbose=False
    )
    assert len(packed) < len(data) / 2  # really packed
    model = PackedFamilyModel.from_pretrained(folder, KIND[task])
    trainer = trainer_for(model, tmp_path / "run", task, packed, packed)
    before = {k: v.detach().clone() for k, v in model.hf_model.state_dict().items()}
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in model.hf_model.state_dict().items())  # it trained

    saved = tmp_path / "saved"
    trainer.save_model(str(saved))
    expected, losses = stock_outputs(saved, task, data)  # transformers' Auto class loads the folder
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(float(losses.mean()), abs=1e-5)

    prediction = trainer.predict(packed)
    rows = unpack_predictions(task, prediction.predictions, prediction.label_ids)
    for i, want in enumerate(expected):  # input order, each example's own outputs
        if task == "question_answering":
            n = len(data[i]["input_ids"])
            np.testing.assert_allclose(rows.predictions[0][i][:n], want[0], atol=1e-5, rtol=0)
            np.testing.assert_allclose(rows.predictions[1][i][:n], want[1], atol=1e-5, rtol=0)
            assert np.isneginf(rows.predictions[0][i][n:]).all()
        else:
            np.testing.assert_allclose(rows.predictions[i], want, atol=1e-5, rtol=0)


def test_gradient_accumulation_and_resume_give_the_same_weights_for_a_family(tmp_path):
    """RoBERTa under Trainer: 2 micro-batches of 2 packs make the step of one batch of 4
    (num_items_in_batch reaches the loss), and a run resumed from its checkpoint (the
    folder save_pretrained wrote, read back by load_state_dict) ends where an
    uninterrupted one does."""
    task = "single_label_classification"
    folder = save_family_folder(tmp_path / "start", "roberta", "classification")
    packed = pack_dataset(labelled_dataset(folder, task), task, 128, 4, num_labels=3, verbose=False)

    def final_weights(run, model=None, resume=None, **arguments):
        model = model or PackedFamilyModel.from_pretrained(folder, "classification")
        # Plain SGD, no clipping: a loss normalised over the wrong count changes the update.
        trainer = trainer_for(
            model, run, task, packed, optim="sgd", max_grad_norm=0.0, learning_rate=5e-2, max_steps=3, **arguments
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return {k: v.detach().clone() for k, v in model.hf_model.state_dict().items()}

    one = final_weights(tmp_path / "a")
    two = final_weights(tmp_path / "b", per_device_train_batch_size=2, gradient_accumulation_steps=2)
    for name in one:
        torch.testing.assert_close(one[name], two[name], atol=2e-6, rtol=1e-5, msg=name)

    final_weights(tmp_path / "c", save_strategy="steps", save_steps=2)
    resumed = final_weights(tmp_path / "c", resume=str(tmp_path / "c" / "checkpoint-2"))
    for name in one:
        torch.testing.assert_close(resumed[name], one[name], atol=2e-6, rtol=1e-5, msg=name)

    model = PackedFamilyModel.from_pretrained(folder, "classification")
    wrong = {"roberta.embeddings.word_embeddings.weight": torch.zeros(1)}
    with pytest.raises(RuntimeError):  # a checkpoint that is not this model's is loud, not partial
        model.load_state_dict(wrong, strict=False)
