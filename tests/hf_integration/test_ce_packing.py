"""Packing inside sentence-transformers' CrossEncoder (hf_integration/st_packing.py,
`pack_cross_encoder`; issue 109 item 2), judged by sentence-transformers itself: for the same
(query, passage) pairs the packed reranker's loss and the gradient of every parameter equal its
padded computation (BERT, whose head reads the pooler run again on the states put back; RoBERTa,
whose head reads the first token), under BinaryCrossEntropyLoss, the grouped
MultipleNegativesRankingLoss and the listwise LambdaLoss; `predict` gives the padded scores; its own CrossEncoderTrainer
ends on the same weights packed or not; the folder it saves scores alike in transformers'
AutoModelForSequenceClassification."""

from __future__ import annotations

import pytest
import torch

from packed_transformers.hf_integration.st_packing import pack_cross_encoder

from ..family_helpers import TEXTS, save_family_folder

QUERIES = [t.split(",")[0][:30] for t in TEXTS[:6]]
# passages of mixed length (a reranker's case: a short query joined to a passage of any length)
PASSAGES = [t[:n] for t, n in zip(TEXTS[6:12], (15, 200, 25, 90, 300, 10))]
NEGATIVES = [t[:n] for t, n in zip(TEXTS[12:18], (150, 30, 70, 260, 45, 110))]
LABELS = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny random one-logit rerankers (dropout off): BERT (pooler) and RoBERTa."""
    root = tmp_path_factory.mktemp("ce_packing")
    return {f: save_family_folder(root / f, f, "classification", num_labels=1, id2label={0: "LABEL_0"})
            for f in ("bert", "roberta")}  # fmt: skip


def cross_encoder(folder):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(folder), num_labels=1, max_length=60, device="cpu")


def step(folder, loss_name: str, packed: bool):
    """One step of sentence-transformers' loss in float64: (loss, {name: gradient}, packing)."""
    from sentence_transformers.cross_encoder import losses

    model = cross_encoder(folder)
    model.double().eval()
    packing = pack_cross_encoder(model) if packed else None
    torch.manual_seed(0)  # the grouped loss draws its in-batch negatives at random
    if loss_name == "bce":
        loss = losses.BinaryCrossEntropyLoss(model)([QUERIES, PASSAGES], LABELS.double())
    elif loss_name == "grouped":  # one positive against the negatives of the group, in one softmax
        loss = losses.MultipleNegativesRankingLoss(model, num_negatives=2)(
            [QUERIES, PASSAGES, NEGATIVES], None
        )
    else:  # listwise: each query's candidates ranked together (the lists of unequal lengths)
        docs = [
            [p, n] if i % 2 else [p, n, NEGATIVES[(i + 1) % 6]]
            for i, (p, n) in enumerate(zip(PASSAGES, NEGATIVES))
        ]
        graded = [torch.tensor([2.0, 0.0] if i % 2 else [1.0, 0.0, 0.5]) for i in range(6)]
        loss = losses.LambdaLoss(model)([QUERIES, docs], graded)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, packing


@pytest.mark.parametrize("family", ["bert", "roberta"])
@pytest.mark.parametrize("loss_name", ["bce", "grouped", "listwise"])
def test_packed_loss_and_every_gradient_equal_the_padded_ones(folders, family, loss_name):
    theirs, their_grads, _ = step(folders[family], loss_name, packed=False)
    ours, our_grads, packing = step(folders[family], loss_name, packed=True)
    assert packing.count.packed_cells < packing.count.padded_cells  # some pairs shared a row
    assert abs(ours - theirs) <= 1e-10, (ours, theirs)
    assert our_grads.keys() == their_grads.keys() and any("classifier" in n for n in our_grads)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-9, atol=1e-10, msg=name)


def test_predict_gives_the_padded_scores_and_remove_gives_back_the_padded_model(folders):
    model = cross_encoder(folders["bert"])
    pairs = list(zip(QUERIES, PASSAGES + NEGATIVES))
    padded = model.predict(pairs, batch_size=16)
    packing = pack_cross_encoder(model)
    packed = model.predict(pairs, batch_size=16)
    assert packing.count.packed_cells < packing.count.padded_cells
    torch.testing.assert_close(torch.as_tensor(packed), torch.as_tensor(padded), rtol=1e-5, atol=1e-6)
    packing.remove()
    cells = packing.count.packed_cells
    model.predict(pairs, batch_size=16)
    assert packing.count.packed_cells == cells  # padded again: nothing laid out


def trained(folder, tmp_path, packed: bool):
    from datasets import Dataset
    from sentence_transformers.cross_encoder import CrossEncoderTrainer, CrossEncoderTrainingArguments, losses

    model = cross_encoder(folder)
    packing = pack_cross_encoder(model) if packed else None
    pairs = Dataset.from_dict({"query": QUERIES * 4, "passage": (PASSAGES + NEGATIVES) * 2,
                               "label": [1.0, 0.0, 1.0, 1.0, 0.0, 0.0] * 4})  # fmt: skip
    args = CrossEncoderTrainingArguments(
        output_dir=str(tmp_path / f"ce-{packed}"), per_device_train_batch_size=8, max_steps=3, learning_rate=0.1,
        optim="sgd", logging_steps=1, seed=0, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = CrossEncoderTrainer(
        model=model, args=args, train_dataset=pairs, loss=losses.BinaryCrossEntropyLoss(model)
    )
    trainer.train()
    return model, packing, [e["loss"] for e in trainer.state.log_history if "loss" in e]


@pytest.mark.slow
def test_their_trainer_trains_the_packed_reranker_to_the_same_weights_and_it_loads_in_transformers(
    folders, tmp_path
):
    import transformers

    padded, _, their_losses = trained(folders["bert"], tmp_path, packed=False)
    packed, packing, our_losses = trained(folders["bert"], tmp_path, packed=True)
    assert packing.count.packed_cells < packing.count.padded_cells
    assert len(our_losses) == len(their_losses) == 3
    torch.testing.assert_close(torch.tensor(our_losses), torch.tensor(their_losses), rtol=1e-5, atol=1e-5)
    before = dict(cross_encoder(folders["bert"]).named_parameters())
    theirs, ours = dict(padded.named_parameters()), dict(packed.named_parameters())
    assert any(not torch.equal(theirs[n], before[n]) for n in theirs)  # the steps moved the weights
    for name, weight in theirs.items():
        torch.testing.assert_close(ours[name], weight, rtol=1e-4, atol=1e-5, msg=name)
    # the saved folder: transformers' own classifier scores the pairs as the packed reranker does
    packed.save_pretrained(str(tmp_path / "saved"))
    assert "packed" not in (tmp_path / "saved" / "config.json").read_text()
    classifier = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "saved").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "saved")
    batch = tokenizer(QUERIES, PASSAGES, padding=True, truncation=True, max_length=60, return_tensors="pt")
    with torch.no_grad():
        logits = classifier(**batch).logits.view(-1)
    scores = packed.predict(list(zip(QUERIES, PASSAGES)), activation_fn=torch.nn.Identity())
    torch.testing.assert_close(torch.as_tensor(scores), logits, rtol=1e-5, atol=1e-5)
