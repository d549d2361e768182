"""Decoders packed without cross-contamination (model/families.py): per family, packed rows
give transformers' own model's outputs for each example run alone, in float32: causal-LM
logits and loss (and the gradients of the packed batch loss), sequence-classification
logits (the last token's score) and last-token embeddings. Sliding windows are set small so
that they act inside the sequences; rows hold one-token sequences and sequences that end
exactly at the row's end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ..decoder_helpers import ROWS, VOCAB, K, S, decoder_tokenizer, packed_rows, tiny_config  # noqa: F401  # noqa: F401

TOLERANCE = 1e-5


DECODERS = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "gpt2"]


def where_each_sequence_is(layout=None):
    for row, lengths in enumerate(ROWS if layout is None else layout):
        start = 0
        for length in lengths:
            yield row, start, length
            start += length


@pytest.fixture(scope="module", params=DECODERS)
def decoder_folders(request, tmp_path_factory):
    """One folder per head (causal LM, sequence classification, bare) of one random family model."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(tiny_config(model_type))
    lm.save_pretrained(root / "lm")
    classifier = AutoModelForSequenceClassification.from_config(tiny_config(model_type, num_labels=3))
    classifier.save_pretrained(root / "classifier")
    AutoModel.from_config(tiny_config(model_type)).save_pretrained(root / "bare")
    return model_type, root


def reference(auto, folder):
    import transformers

    return getattr(transformers, auto).from_pretrained(folder, attn_implementation="eager").eval()


@pytest.mark.parametrize("granularity", [0, 4], ids=["mask", "length-buckets"])
def test_causal_lm_logits_loss_and_gradients_equal_each_example_alone(decoder_folders, granularity):
    """Through the row's mask and through length buckets (model.causal_buckets: buckets of
    4, 8, ... tokens, so that sliding windows of 4 act inside them)."""
    from packed_transformers.model.family_model import PackedFamilyModel

    model_type, root = decoder_folders
    rows, sequences = packed_rows()
    packed = PackedFamilyModel.from_pretrained(root / "lm", "causal_lm").eval()
    packed.attention_granularity = granularity
    stock = reference("AutoModelForCausalLM", root / "lm")
    out = packed(**rows, labels=rows["input_ids"])
    losses, counts = [], []
    for (row, start, length), ids in zip(where_each_sequence_is(), sequences):
        alone = stock(input_ids=torch.as_tensor(ids)[None], labels=torch.as_tensor(ids)[None])
        got = out["logits"][row, start : start + length]
        assert (got - alone.logits[0]).abs().max() <= TOLERANCE, (model_type, row, start)
        if length > 1:  # a one-token sequence predicts nothing
            losses.append(alone.loss * (length - 1))
            counts.append(length - 1)
    expected = torch.stack(losses).sum() / sum(counts)
    assert abs(out["loss"].item() - expected.item()) <= TOLERANCE
    assert int(out["token_count"]) == sum(counts)
    out["loss"].backward()
    expected.backward()
    ours = dict(packed.hf_model.named_parameters())
    for name, p in stock.named_parameters():
        grad = ours[name].grad
        assert (grad - p.grad).abs().max() <= 1e-5 * max(p.grad.abs().max().item(), 1.0), (model_type, name)


@pytest.fixture(scope="module")
def llama_and_qwen2(tmp_path_factory):
    """A Llama (global attention) and a Qwen2 with a 4-token sliding layer, random, float32."""
    from transformers import AutoModelForCausalLM

    from packed_transformers.model.family_model import PackedFamilyModel

    models = []
    for model_type in ("llama", "qwen2"):
        folder = tmp_path_factory.mktemp(f"h_{model_type}")
        torch.manual_seed(1)
        AutoModelForCausalLM.from_config(tiny_config(model_type)).save_pretrained(folder)
        models.append((PackedFamilyModel.from_pretrained(folder, "causal_lm").eval(),
                       reference("AutoModelForCausalLM", folder)))  # fmt: skip
    return models


def row_layouts():
    """1-3 rows of 1..K sequences of 1..S tokens each, each row within S tokens (some end at
    the row's very end)."""
    from hypothesis import strategies as st

    row = st.lists(st.integers(1, S), min_size=1, max_size=K).filter(lambda lengths: sum(lengths) <= S)
    return st.lists(row, min_size=1, max_size=3)


def test_any_layout_gives_each_sequence_its_own_logits_and_loss(llama_and_qwen2):
    """Hypothesis over lengths and layouts (one-token sequences, sequences ending at the row's
    end, full rows): packed logits and the packed loss equal transformers per sequence."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=25, deadline=None)
    @given(layout=row_layouts(), granularity=st.sampled_from([0, 4, 16]))
    def check(layout, granularity):
        rows, sequences = packed_rows(len(layout), layout)
        for packed, stock in llama_and_qwen2:
            packed.attention_granularity = granularity  # the mask, or length buckets
            with torch.no_grad():
                out = packed(**rows, labels=rows["input_ids"])
                total, count = 0.0, 0
                for (row, start, length), ids in zip(where_each_sequence_is(layout), sequences):
                    alone = stock(input_ids=torch.as_tensor(ids)[None], labels=torch.as_tensor(ids)[None])
                    assert (
                        out["logits"][row, start : start + length] - alone.logits[0]
                    ).abs().max() <= TOLERANCE
                    if length > 1:
                        total, count = total + alone.loss.item() * (length - 1), count + length - 1
            assert int(out["token_count"]) == count
            if count:
                assert abs(out["loss"].item() - total / count) <= TOLERANCE

    check()


def test_the_shift_and_the_attention_stay_inside_each_sequence(decoder_folders):
    """Changing one sequence's tokens changes no other sequence's logits or targets; the last
    token of a sequence has no target (mutation check of the shift and the mask)."""
    from packed_transformers.model.families import IGNORED, next_token_targets
    from packed_transformers.model.family_model import PackedFamilyModel

    _, root = decoder_folders
    rows, _ = packed_rows(1)
    packed = PackedFamilyModel.from_pretrained(root / "lm", "causal_lm").eval()
    before = packed(**rows)["logits"]
    changed = {n: t.clone() for n, t in rows.items()}
    changed["input_ids"][0, 0:5] = 3  # the first sequence of row 0
    after = packed(**changed)["logits"]
    assert torch.equal(before[0, 5:], after[0, 5:]) and torch.equal(before[1:], after[1:])
    assert not torch.equal(before[0, :5], after[0, :5])
    targets = next_token_targets(rows["input_ids"], rows["sequence_ids"])
    assert (
        targets[0, 4] == IGNORED and targets[0, 13] == IGNORED and targets[0, 14] == IGNORED
    )  # ends of 5, 9, 1
    assert targets[2, 23] == IGNORED and targets[0, 3] == rows["input_ids"][0, 4]


def test_classification_and_last_token_embeddings_equal_each_example_alone(decoder_folders):
    from packed_transformers.model.family_model import PackedFamilyModel

    model_type, root = decoder_folders
    rows, sequences = packed_rows(2)
    classifier = PackedFamilyModel.from_pretrained(root / "classifier", "classification").eval()
    stock = reference("AutoModelForSequenceClassification", root / "classifier")
    logits = classifier(**rows)["logits"]
    embedder = PackedFamilyModel.from_pretrained(root / "bare", "embedding", ("lasttoken",)).eval()
    bare = reference("AutoModel", root / "bare")
    embeddings = embedder(**rows)["embeddings"]
    with torch.no_grad():
        for i, ids in enumerate(sequences):
            row, slot = map(int, (rows["example_index"] == i).nonzero()[0])
            alone = stock(input_ids=torch.as_tensor(ids)[None]).logits[0]
            assert (logits[row, slot] - alone).abs().max() <= TOLERANCE, (model_type, i)
            last = bare(input_ids=torch.as_tensor(ids)[None]).last_hidden_state[0, -1]
            assert (embeddings[row, slot] - last).abs().max() <= TOLERANCE, (model_type, i)


@pytest.mark.slow  # a real Trainer: evaluate, train, save, reload
def test_trainer_trains_a_packed_decoder_and_saves_a_folder_transformers_loads(tmp_path):
    """pack_dataset(task="causal_lm") with prompt tokens masked (-100) in half the examples;
    Trainer's eval_loss on packs = the stock model's token-weighted mean over the examples one
    at a time; after training, the saved folder loads in AutoModelForCausalLM with every weight
    and gives the packed model's logits per example."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from packed_transformers.hf_integration.trainer import PackedDataCollator, pack_dataset
    from packed_transformers.model.family_model import PackedFamilyModel

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path / "start")
    rng = np.random.default_rng(0)
    sequences = [rng.integers(3, VOCAB, size=int(n)).tolist() for n in rng.integers(2, 20, size=24)]
    labels = [[-100, -100, *s[2:]] if i % 2 else list(s) for i, s in enumerate(sequences)]
    data = Dataset.from_dict({"input_ids": sequences, "labels": labels})
    train = pack_dataset(data, "causal_lm", 32, max_sequences_per_pack=4, verbose=False)
    evaluation = pack_dataset(data.select(range(8)), "causal_lm", 32, max_sequences_per_pack=4, verbose=False)
    model = PackedFamilyModel.from_pretrained(tmp_path / "start", "causal_lm")
    arguments = TrainingArguments(
        output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=4, per_device_eval_batch_size=len(evaluation),
        learning_rate=1e-3, max_steps=3, report_to=[], use_cpu=True, save_strategy="no", seed=0,
        prediction_loss_only=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=arguments, train_dataset=train, eval_dataset=evaluation,
                      data_collator=PackedDataCollator())  # fmt: skip

    def stock_mean_loss(folder, count=8):
        stock = AutoModelForCausalLM.from_pretrained(folder).eval()
        total, tokens = 0.0, 0
        with torch.no_grad():
            for ids, own in zip(sequences[:count], labels[:count]):
                predicted = sum(1 for t in own[1:] if t != -100)
                if predicted:
                    out = stock(input_ids=torch.tensor([ids]), labels=torch.tensor([own]))
                    total, tokens = total + out.loss.item() * predicted, tokens + predicted
        return total / tokens

    # shift_labels reaches the model (Trainer keeps the columns its forward names) and Trainer
    # counts it as num_items_in_batch: the predicted tokens, none across a sequence's end
    assert sorted(trainer.label_names) == ["labels", "shift_labels"]
    assert abs(trainer.evaluate()["eval_loss"] - stock_mean_loss(tmp_path / "start")) <= 1e-5
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert abs(trainer.evaluate()["eval_loss"] - stock_mean_loss(tmp_path / "out")) <= 1e-5
    rows = PackedDataCollator()([evaluation[i] for i in range(len(evaluation))])
    model.eval()
    with torch.no_grad():
        logits = model(**{k: v for k, v in rows.items() if k not in ("labels", "shift_labels")})["logits"]
        for row, slot in zip(*np.nonzero(rows["example_index"].numpy() >= 0)):
            example = int(rows["example_index"][row, slot])
            start, ids = int(rows["cls_positions"][row, slot]), sequences[example]
            alone = reloaded(input_ids=torch.tensor([ids])).logits[0]
            assert (logits[row, start : start + len(ids)] - alone).abs().max() <= TOLERANCE


@pytest.mark.slow  # two processes under torchrun, and one alone
def test_trainer_over_two_processes_ends_on_the_weights_of_one_process(tmp_path):
    """Trainer (DDP over gloo, CPU) trains the packed decoder unchanged: 2 processes x 2
    accumulated packs per step end on the weights of 1 process x 4 packs per step over the same
    packs, in the same order: the token-weighted loss (num_items_in_batch summed over the
    processes) and the gradient reduction agree with one process."""
    import os
    import sys

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ..conftest import REPO
    from ..processes import run_in_group

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path / "start")
    script = str(REPO / "tests" / "ddp_decoder_train.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # --standalone: the rendezvous on a free port torchrun picks (a port computed from the pid
    # could be another test's); the ranks run in a group of their own, killed whole on a
    # timeout, and a rank left running after torchrun ends fails the test (tests/processes.py)
    runs = {
        "two": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                script, str(tmp_path / "start"), str(tmp_path / "two.safetensors"), "2"],
        "one": [sys.executable, script, str(tmp_path / "start"), str(tmp_path / "one.safetensors"), "4"],
    }  # fmt: skip
    for name, command in runs.items():
        done = run_in_group(command, timeout=300, cwd=REPO, env=env)
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
    two, one = load_file(tmp_path / "two.safetensors"), load_file(tmp_path / "one.safetensors")
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "start").state_dict()
    assert two.keys() == one.keys()
    moved = 0
    for name in start:  # the transformers model inside PackedFamilyModel (hf_model): every weight
        ours = f"hf_model.{name}"
        torch.testing.assert_close(two[ours], one[ours], atol=1e-6, rtol=1e-5, msg=name)
        moved += int(not torch.equal(one[ours], start[name]))
    assert moved >= len(start) // 2  # it trained: most tensors changed


def test_pack_dataset_truncates_or_splits_long_causal_examples():
    from datasets import Dataset

    from packed_transformers.hf_integration.trainer import pack_dataset

    data = Dataset.from_dict({"input_ids": [list(range(3, 40)), [5, 6, 7]]})
    truncated = pack_dataset(data, "causal_lm", 16, verbose=False)
    kept = [
        p["input_ids"][p["sequence_ids"] == s]
        for p in truncated
        for s in range(1, 7)
        if (p["sequence_ids"] == s).any()
    ]
    assert sorted(map(list, kept)) == sorted([list(range(3, 19)), [5, 6, 7]])  # the first 16 tokens kept
    split = pack_dataset(data, "causal_lm", 16, verbose=False, split_long=True)
    assert sum(int((p["sequence_ids"] > 0).sum()) for p in split) == 37 + 3
    for pack in split:  # targets never cross a piece's end
        ends = np.flatnonzero(np.diff(pack["sequence_ids"]) != 0)
        assert all(pack["shift_labels"][e] == -100 for e in ends)


@pytest.mark.slow  # whole commands
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gpt2"])
def test_predict_and_embed_take_decoder_folders(tmp_path, model_type):
    """commands.predict and the server's /predict on an XxxForSequenceClassification folder
    equal transformers on each text alone (its last token's score); commands.embed on a sentence-transformers folder with
    last-token pooling equals SentenceTransformer.encode."""
    import json

    import transformers
    from sentence_transformers import SentenceTransformer, models

    from packed_transformers.commands import embed, predict

    from ..family_helpers import TEXTS

    tokenizer = decoder_tokenizer()
    vocabulary = len(tokenizer)
    torch.manual_seed(0)
    classifier = transformers.AutoModelForSequenceClassification.from_config(
        tiny_config(model_type, num_labels=3, vocab_size=vocabulary)
    )
    classifier.save_pretrained(tmp_path / "classifier")
    tokenizer.save_pretrained(tmp_path / "classifier")
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    argv = [
        "--model",
        str(tmp_path / "classifier"),
        "--input",
        str(source),
        "--output",
        str(tmp_path / "p.jsonl"),
    ]
    assert predict.main(argv) == 0
    got = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    classifier.eval()
    with torch.no_grad():
        for record, text in zip(got, TEXTS):
            logits = classifier(**tokenizer(text, truncation=True, return_tensors="pt")).logits[0]
            np.testing.assert_allclose(
                list(record["scores"].values()), torch.softmax(logits, -1).numpy(), atol=1e-5
            )
    # the server's /predict (TEI's API) on the same folder: the same scores, per text
    import httpx

    from ..servers import Server

    with Server(tmp_path / "classifier") as server:
        answered = httpx.post(
            server.url + "/predict", json={"inputs": [[t] for t in TEXTS], "truncate": True}, timeout=60
        )
    assert answered.status_code == 200, answered.text
    for record, scored in zip(got, answered.json()):
        served = {entry["label"]: entry["score"] for entry in scored}
        assert served.keys() == record["scores"].keys()
        np.testing.assert_allclose(
            [served[k] for k in record["scores"]], list(record["scores"].values()), atol=1e-5
        )

    transformers.AutoModel.from_config(tiny_config(model_type, vocab_size=vocabulary)).save_pretrained(
        tmp_path / "bare"
    )
    tokenizer.save_pretrained(tmp_path / "bare")
    transformer = models.Transformer(str(tmp_path / "bare"), max_seq_length=48)
    pooling = models.Pooling(transformer.get_word_embedding_dimension(), "lasttoken")
    st_model = SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu")
    st_model.save(str(tmp_path / "st"))
    output = tmp_path / "e.npy"
    assert (
        embed.main(
            ["--model", str(tmp_path / "st"), "--input", str(source), "--output", str(output), "--quiet"]
        )
        == 0
    )
    expected = SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(TEXTS, convert_to_numpy=True)
    cosine = (np.load(output) * expected).sum(-1)
    assert cosine.min() >= 0.99999, cosine.min()


def test_gpt2_with_a_tokenizer_that_hands_token_types_is_fed_them_as_transformers_is(tmp_path):
    """GPT-2 has no token-type table: when its tokenizer hands token_type_ids (a BERT
    WordPiece over GPT-2 weights, as some GPT-2 models ship), transformers embeds them with
    the token table. The packed model is given them too (they were once dropped: cosine 0.75)."""
    import transformers
    from sentence_transformers import SentenceTransformer, models

    from packed_transformers.data.assets import model_dir
    from packed_transformers.inference.embedding import load_encoder, packed_encode

    from ..family_helpers import TEXTS

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir())
    assert "token_type_ids" in tokenizer.model_input_names
    torch.manual_seed(0)
    transformers.AutoModel.from_config(tiny_config("gpt2", vocab_size=len(tokenizer))).save_pretrained(
        tmp_path / "g"
    )
    tokenizer.save_pretrained(tmp_path / "g")
    transformer = models.Transformer(str(tmp_path / "g"), max_seq_length=48)
    pooling = models.Pooling(transformer.get_embedding_dimension(), "lasttoken")
    st_model = SentenceTransformer(modules=[transformer, pooling], device="cpu")
    expected = st_model.encode(TEXTS, batch_size=4, convert_to_numpy=True)
    st_model.save(str(tmp_path / "st"))

    def cosine(a, b):
        return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)

    assert cosine(packed_encode(st_model, TEXTS), expected).min() >= 0.99999
    from packed_transformers.inference.embedding import encode

    assert cosine(encode(TEXTS, load_encoder(tmp_path / "st")), expected).min() >= 0.99999


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])  # gemma3: the head's soft-capping
def test_training_runs_the_head_only_on_predicted_tokens_with_the_same_loss_and_gradients(
    model_type, tmp_path
):
    """In training mode with labels the LM head runs on the tokens that have a target only
    (skip_logits, as Liger Kernel's causal LMs): the loss, every gradient and the predicted
    tokens' logits equal the full-logits forward's; prompt tokens (-100) have no logits."""
    import transformers

    from packed_transformers.model.families import next_token_targets
    from packed_transformers.model.family_model import PackedFamilyModel

    torch.manual_seed(0)
    extra = {"final_logit_softcapping": 5.0} if model_type == "gemma3_text" else {}
    transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **extra)).save_pretrained(tmp_path)
    model = PackedFamilyModel.from_pretrained(tmp_path, "causal_lm").train()
    rows, _ = packed_rows(seed=3)
    labels = rows["input_ids"].clone()
    labels[:, ::3] = -100  # a prompt-like share of tokens without a target
    runs = {}
    for skip in (False, True):
        model.zero_grad(set_to_none=True)
        out = model(**rows, labels=labels, skip_logits=skip)
        out.loss.backward()
        runs[skip] = (out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (full, full_grads), (kept, kept_grads) = runs[False], runs[True]
    assert kept.logits is None and full.logits.shape[:2] == labels.shape
    assert int(kept.token_count) == int(full.token_count) == kept.predicted_targets.numel()
    torch.testing.assert_close(kept.loss, full.loss, rtol=1e-6, atol=1e-6)
    targets = next_token_targets(labels, rows["sequence_ids"])
    where = targets != -100
    torch.testing.assert_close(kept.predicted_logits, full.logits[where], rtol=1e-5, atol=1e-6)
    assert torch.equal(kept.predicted_targets, targets[where])
    assert kept_grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(kept_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="needs labels"):
        model(**rows, skip_logits=True)
