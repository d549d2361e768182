"""Packed BERT equals transformers' BertForPreTraining run on the sequences unpacked."""

import numpy as np
import pytest
import torch

from packed_transformers.model import PackedBertForPreTraining

from ..model_helpers import (  # noqa: F401  # noqa: F401
    BACKENDS,
    VOCAB,
    K,
    M,
    S,
    _compare_outputs,
    flex_available,  # noqa: F401
    group_into_packs,
    hf_batch,
    packed_batch,
    random_sequences,
    reference_for,
    tiny_config,
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outputs_losses_and_gradients_match_transformers(backend, seed):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = PackedBertForPreTraining(tiny_config(backend)).eval()
    ref = reference_for(model).eval()
    sequences = random_sequences(rng, 9, VOCAB)
    packs = group_into_packs(sequences, S, int(rng.integers(1, K + 1)))
    batch = packed_batch(packs, S, K, M, VOCAB)
    # FlexAttention has no backward on CPU (torch 2.13), where this test runs, GPU or not:
    # compare its forward pass only (tests/model/test_cuda.py checks flex's gradients on CUDA).
    no_backward = backend == "flex"
    with torch.set_grad_enabled(not no_backward):
        out = _compare_outputs(model, ref, sequences, packs, batch)
        ref_out = ref(**hf_batch(sequences))
    torch.testing.assert_close(out["loss"], ref_out.loss, atol=1e-5, rtol=1e-5)
    assert int(out["nsp_count"]) == len(sequences)
    assert int(out["mlm_count"]) == sum(len(s.masked_lm_positions) for s in sequences)
    if no_backward:
        return

    out["loss"].backward()
    ref_out.loss.backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g, rg = p.grad, ref_grads[name].grad
        # relative 1e-5; the 1e-9 floor covers gradients that are zero in exact arithmetic
        # (e.g. the key bias, to which softmax is invariant) and are fp noise in both.
        assert (g - rg).abs().max() <= 1e-5 * rg.abs().max() + 1e-9, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_agree(backend):
    torch.manual_seed(0)
    base = PackedBertForPreTraining(tiny_config("dense")).eval()
    other = PackedBertForPreTraining(tiny_config(backend)).eval()
    other.load_state_dict(base.state_dict())
    seqs = random_sequences(np.random.default_rng(5), 8, VOCAB)
    batch = packed_batch(group_into_packs(seqs, S, K), S, K, M, VOCAB)
    with torch.no_grad():
        a, b = base(**batch), other(**batch)
    torch.testing.assert_close(a["mlm_logits"], b["mlm_logits"], atol=1e-5, rtol=0)
    torch.testing.assert_close(a["loss"], b["loss"], atol=1e-6, rtol=0)


def test_per_sequence_mlm_loss_mode():
    torch.manual_seed(0)
    model = PackedBertForPreTraining(tiny_config(mlm_loss_mode="per_sequence")).eval()
    ref = reference_for(model).eval()
    seqs = random_sequences(np.random.default_rng(3), 7, VOCAB)
    out = model(**packed_batch(group_into_packs(seqs, S, K), S, K, M, VOCAB))
    per_seq = []
    for s in seqs:
        labels = torch.full((1, len(s.input_ids)), -100)
        labels[0, torch.from_numpy(s.masked_lm_positions)] = torch.from_numpy(s.masked_lm_ids)
        logits = ref(
            input_ids=torch.from_numpy(s.input_ids)[None],
            token_type_ids=torch.from_numpy(s.segment_ids)[None],
        ).prediction_logits
        per_seq.append(torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100))
    torch.testing.assert_close(out["mlm_loss"], torch.stack(per_seq).mean(), atol=1e-5, rtol=1e-5)
    assert int(out["mlm_sequence_count"]) == len(seqs)


def test_sums_and_counts_combine_exactly_across_micro_batches():
    torch.manual_seed(0)
    model = PackedBertForPreTraining(tiny_config()).eval()
    seqs = random_sequences(np.random.default_rng(4), 12, VOCAB)
    packs = group_into_packs(seqs, S, K)
    whole = model(**packed_batch(packs, S, K, M, VOCAB))
    halves = [model(**packed_batch(packs[i::2], S, K, M, VOCAB)) for i in (0, 1)]
    for key in ("mlm_correct", "mlm_count", "nsp_correct", "nsp_count"):
        assert int(whole[key]) == sum(int(h[key]) for h in halves)
    total = sum(h["mlm_loss_sum"] for h in halves) / sum(h["mlm_count"] for h in halves)
    torch.testing.assert_close(whole["mlm_loss"], total)


def test_dropout_in_train_mode_agrees_in_distribution():
    torch.manual_seed(0)
    config = tiny_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = PackedBertForPreTraining(config).train()
    ref = reference_for(model).train()
    seqs = random_sequences(np.random.default_rng(6), 6, VOCAB)
    batch = packed_batch(group_into_packs(seqs, S, K), S, K, M, VOCAB)
    hf = hf_batch(seqs)
    with torch.no_grad():
        ours = torch.stack([model(**batch)["loss"] for _ in range(150)])
        theirs = torch.stack([ref(**hf).loss for _ in range(150)])
    standard_error = torch.sqrt(ours.var() / 150 + theirs.var() / 150)
    assert (ours.mean() - theirs.mean()).abs() < 4 * standard_error
    assert ours.std() > 0  # dropout is really active


def test_flex_refuses_attention_dropout():
    config = tiny_config("flex", attention_probs_dropout_prob=0.1)
    model = PackedBertForPreTraining(config).train()
    seqs = random_sequences(np.random.default_rng(0), 2, VOCAB)
    with pytest.raises(ValueError, match="no attention dropout"):
        model(**packed_batch(group_into_packs(seqs, S, K), S, K, M, VOCAB))


def test_recompute_gives_same_gradients():
    torch.manual_seed(0)
    plain = PackedBertForPreTraining(tiny_config()).train()
    recomputed = PackedBertForPreTraining(tiny_config(recompute_layers=True)).train()
    recomputed.load_state_dict(plain.state_dict())
    seqs = random_sequences(np.random.default_rng(1), 6, VOCAB)
    batch = packed_batch(group_into_packs(seqs, S, K), S, K, M, VOCAB)
    plain(**batch)["loss"].backward()
    recomputed(**batch)["loss"].backward()
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
