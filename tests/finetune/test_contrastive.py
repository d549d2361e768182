"""Packed contrastive training of embedding models (data.task: embedding; model/embedding.py PackedContrastive,
finetune/jobs.py contrastive_job), judged by sentence-transformers: for the same step's texts the
packed MultipleNegativesRankingLoss and the gradient of every parameter equal its padded
computation (BERT, a non-BERT encoder, a decoder embedder pooled at its last token; with and
without hard negatives); a text never attends to another of its row; a run writes a
sentence-transformers folder that SentenceTransformer and `packed embed` load."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from packed_transformers.door.opener import ForEmbedding, ForTraining, open_folder
from packed_transformers.model.embedding import PackedContrastive
from packed_transformers.model.opening import ModelOptions
from packed_transformers.packs.rows import pair_rows

from ..family_helpers import TEXTS, save_family_folder

ANCHORS = [t.split(",")[0][:40] for t in TEXTS[:6]]
POSITIVES = TEXTS[6:12]
NEGATIVES = TEXTS[12:18]


def step_batch(roles: list, width: int, max_per_pack=None) -> dict:
    """The contrastive job's rows of one step (packs.rows.pair_rows) as tensors."""
    rows = pair_rows(roles, np.arange(len(roles[0])), width, max_per_pack, "lpfhp", 0)
    return {name: torch.from_numpy(value) for name, value in rows.items()}


def sentence_transformer(folder, pooling: str):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    transformer = models.Transformer(str(folder), max_seq_length=60)
    return SentenceTransformer(modules=[transformer, models.Pooling(transformer.get_embedding_dimension(), pooling)],
                               device="cpu")  # fmt: skip


def their_step(folder, pooling: str, roles: list[list[str]], scale: float, symmetric: bool):
    """sentence-transformers' padded step: (loss, {parameter name: gradient})."""
    from sentence_transformers.sentence_transformer import losses

    model = sentence_transformer(folder, pooling).eval()  # dropout off on both sides
    kind = losses.MultipleNegativesSymmetricRankingLoss if symmetric else losses.MultipleNegativesRankingLoss
    loss = kind(model, scale=scale)(
        [model.tokenize(texts) for texts in roles], torch.zeros(len(roles[0]))
    )  # fmt: skip
    loss.backward()
    encoder = model[0].auto_model
    return loss.item(), {name: p.grad for name, p in encoder.named_parameters() if p.grad is not None}


def our_step(folder, pooling: str, roles: list[list[str]], scale: float, symmetric: bool, width: int):
    """The packed step over the same texts: (loss, {transformers' name: gradient}, the rows)."""
    reader = open_folder(folder, ForEmbedding(pooling, max_length=60))
    ids = [reader.tokenize_texts(texts, texts)[0] for texts in roles]
    opened = open_folder(folder, ForTraining("embedding", ModelOptions(pooling=pooling), label=str(folder)))
    model = PackedContrastive(opened.model, scale, symmetric).eval()
    batch = step_batch(ids, width)
    out = model(**batch)
    out["loss"].backward()
    embedder = model.embedder
    named = (
        {k.removeprefix("bert."): p for k, p in embedder.named_parameters()}
        if hasattr(embedder, "bert")
        else dict(embedder.hf_model.named_parameters())
    )
    return float(out["loss"]), {k: p.grad for k, p in named.items() if p.grad is not None}, batch


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny random folders: BERT, DistilBERT (a non-BERT encoder) and a Qwen2 decoder
    (embedded at its last token), each with a real tokenizer of its kind."""
    import transformers

    from ..decoder_helpers import decoder_tokenizer, tiny_config

    root = tmp_path_factory.mktemp("contrastive")
    out = {
        "bert": (save_family_folder(root / "bert", "bert", "embedding"), "mean"),
        "distilbert": (save_family_folder(root / "distilbert", "distilbert", "embedding"), "mean"),
    }
    tokenizer = decoder_tokenizer()
    torch.manual_seed(0)
    # room for the token transformers' Qwen2 tokenizer class adds, as real Qwen2 folders pad their table
    transformers.AutoModel.from_config(tiny_config("qwen2", vocab_size=len(tokenizer) + 8)).save_pretrained(
        root / "qwen2"
    )
    tokenizer.save_pretrained(root / "qwen2")
    out["qwen2"] = (root / "qwen2", "lasttoken")
    return out


@pytest.mark.parametrize(
    "family, negatives, symmetric",
    [("bert", False, False), ("bert", True, False), ("bert", False, True), ("distilbert", True, False),
     ("qwen2", True, False), ("qwen2", False, False)],
)  # fmt: skip
def test_the_packed_step_equals_sentence_transformers_loss_and_every_gradient(
    folders, family, negatives, symmetric
):
    folder, pooling = folders[family]
    roles = [ANCHORS, POSITIVES] + ([NEGATIVES] if negatives else [])
    theirs, their_grads = their_step(folder, pooling, roles, 20.0, symmetric)
    ours, our_grads, batch = our_step(folder, pooling, roles, 20.0, symmetric, width=64)
    assert batch["input_ids"].shape[0] < sum(len(r) for r in roles)  # packed: fewer rows than texts
    assert (batch["sequence_ids"].amax(1) > 1).any()  # some row holds several texts
    assert abs(ours - theirs) <= 1e-5, (ours, theirs)
    assert our_grads.keys() == their_grads.keys()
    # Each gradient is a float32 sum over the step's ~200 tokens, in another order on each side:
    # its rounding scales with the step's largest gradient entries (up to about 6 here), not with
    # the entry compared (a near-zero one sums terms of that size too). A fixed atol of 1e-5 failed
    # a make test and 1 of 17 DistilBERT steps probed (1.16e-5 at a layer norm's bias: the helper's
    # tokenizer is learned anew in each process); the bound stays 1e-5 of the largest gradient.
    atol = 1e-5 * max(1.0, max(float(grad.abs().max()) for grad in their_grads.values()))
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-5, atol=atol, msg=name)


def test_a_text_never_attends_to_another_of_its_row(folders):
    """The anchors' embeddings in packed rows equal each anchor's alone, and do not move when
    the texts packed beside them change (a cross-contaminating mask would move them)."""
    folder, pooling = folders["bert"]
    reader = open_folder(folder, ForEmbedding(pooling, max_length=60))
    embedder = open_folder(
        folder, ForTraining("embedding", ModelOptions(pooling=pooling), label="f")
    ).model.eval()

    def anchor_vectors(positives):
        batch = step_batch([reader.tokenize_texts(texts, texts)[0] for texts in (ANCHORS, positives)], 128)
        slots = batch.pop("anchor_slots")
        batch.pop("positive_slots")
        with torch.no_grad():
            return embedder(**batch)["embeddings"].reshape(-1, embedder.dimension)[slots], batch

    first, batch = anchor_vectors(POSITIVES)
    assert (batch["sequence_ids"].amax(1) > 1).any()
    second, _ = anchor_vectors(NEGATIVES)
    torch.testing.assert_close(first, second, rtol=0, atol=1e-6)
    alone = []
    for text in ANCHORS:
        ids = reader.tokenize_texts([text], [text])[0]
        single = step_batch([ids, ids], 64, max_per_pack=1)
        slots = single.pop("anchor_slots")
        single.pop("positive_slots")
        with torch.no_grad():
            alone.append(embedder(**single)["embeddings"].reshape(-1, embedder.dimension)[slots][0])
    torch.testing.assert_close(first, torch.stack(alone), rtol=0, atol=1e-5)


@pytest.mark.slow  # a short run of MiniLM, then SentenceTransformer and embed on its folder
def test_a_run_writes_a_sentence_transformers_folder_that_both_load(tmp_path):
    from sentence_transformers import SentenceTransformer

    from packed_transformers.commands import embed
    from packed_transformers.data import embedding_texts
    from packed_transformers.finetune import train

    from ..conftest import REPO

    pairs = tmp_path / "pairs.jsonl"
    assert embedding_texts.main(["--kind", "pairs", "--output", str(pairs), "--limit", "48"]) == 0
    first = json.loads(pairs.read_text().splitlines()[0])
    assert set(first) == {"anchor", "positive"} and len(first["positive"]) > 3 * len(first["anchor"])
    argv = ["--config", str(REPO / "configs/finetune_embedding.yaml"), "--output-dir", str(tmp_path / "run"),
            "--set", f"data.train_file={pairs}", "--set", "data.max_sequence_length=64",
            "--set", "batching.batch_size=8", "--set", "training.progress=false"]  # fmt: skip
    assert train.main(argv) == 0
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["task"] == "embedding" and 0 <= summary["validation_ndcg@10"] <= 1
    folder = tmp_path / "run/model"
    texts = [first["anchor"], first["positive"]]
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)
    source = tmp_path / "t.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert embed.main(["--model", str(folder), "--input", str(source), "--output", str(tmp_path / "e.npy"),
                       "--quiet"]) == 0  # fmt: skip
    ours = np.load(tmp_path / "e.npy")
    assert (
        (ours * expected).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(expected, axis=1)
    ).min() >= 0.99999
    # trained: the weights moved from the starting folder's
    from packed_transformers.data.assets import model_dir

    start = SentenceTransformer(str(model_dir()), device="cpu").encode(texts, convert_to_numpy=True)
    assert not np.allclose(start, expected, atol=1e-4)
