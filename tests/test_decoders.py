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

TOLERANCE = 1e-5
VOCAB = 96


def tiny_config(model_type: str, **extra):
    """A small random config of the family (grouped-query heads where it has them)."""
    from transformers import AutoConfig

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
    by_type = {
        "llama": {},
        "mistral": {"sliding_window": 4},
        "qwen2": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1,
                  "layer_types": ["full_attention", "sliding_attention"]},
        "qwen3": {"head_dim": 8},
        "gemma3_text": {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 4,
                        "layer_types": ["sliding_attention", "full_attention"]},
        "phi3": {},
        "gpt2": None,
    }  # fmt: skip
    if model_type == "gpt2":
        settings = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)  # fmt: skip
    else:
        settings = {**common, **by_type[model_type]}
    return AutoConfig.for_model(model_type, **settings, **extra)


DECODERS = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "gpt2"]
S, K = 24, 4
ROWS = [[5, 9, 1], [7], [10, 14], [1, 1, 3]]  # one-token sequences; [10, 14] ends at the row's end


def packed_rows(seed: int = 0):
    """Random token sequences in ROWS' layout -> (the packed rows as tensors, the sequences)."""
    rng = np.random.default_rng(seed)
    sequences, fields = [], {n: np.zeros((len(ROWS), S), np.int64) for n in ("input_ids", "segment_ids",
                                                                          "position_ids", "sequence_ids")}  # fmt: skip
    cls_positions = np.zeros((len(ROWS), K), np.int64)
    example_index = np.full((len(ROWS), K), -1, np.int64)
    for row, lengths in enumerate(ROWS):
        start = 0
        for slot, length in enumerate(lengths):
            ids = rng.integers(3, VOCAB, size=length)
            fields["input_ids"][row, start : start + length] = ids
            fields["position_ids"][row, start : start + length] = np.arange(length)
            fields["sequence_ids"][row, start : start + length] = slot + 1
            cls_positions[row, slot], example_index[row, slot] = start, len(sequences)
            sequences.append(ids)
            start += length
    fields.update(cls_positions=cls_positions, example_index=example_index)
    return {n: torch.as_tensor(v) for n, v in fields.items()}, sequences


def where_each_sequence_is():
    for row, lengths in enumerate(ROWS):
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


def test_causal_lm_logits_loss_and_gradients_equal_each_example_alone(decoder_folders):
    from model.families import PackedFamilyModel

    model_type, root = decoder_folders
    rows, sequences = packed_rows()
    packed = PackedFamilyModel.from_pretrained(root / "lm", "causal_lm").eval()
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


def test_the_shift_and_the_attention_stay_inside_each_sequence(decoder_folders):
    """Changing one sequence's tokens changes no other sequence's logits or targets; the last
    token of a sequence has no target (mutation check of the shift and the mask)."""
    from model.families import IGNORED, PackedFamilyModel, next_token_targets

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
    from model.families import PackedFamilyModel

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
