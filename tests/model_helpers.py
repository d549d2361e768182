"""Random unpacked sequences, their packed batch, and the same as an HF batch; the per-row
cosine the embedding tests compare vectors by."""

import numpy as np
import torch
from transformers import BertForPreTraining

from packed_transformers.data.convert_tf_checkpoint import CONFIG_KEYS
from packed_transformers.model import PackedBertForPreTraining, bert_config
from packed_transformers.packing.format import Sequence, pack_sequences

S, K, M, VOCAB = 48, 3, 12, 97


def random_sequences(rng, count, vocab, min_len=3, max_len=20, max_predictions=4):
    out = []
    for i in range(count):
        length = int(rng.integers(min_len, max_len + 1))
        ids = rng.integers(5, vocab, size=length)
        ids[0] = 2  # [CLS]
        split = int(rng.integers(1, length))
        segments = (np.arange(length) >= split).astype(np.int64)
        p = int(rng.integers(1, min(max_predictions, length - 1) + 1))
        positions = np.sort(rng.choice(np.arange(1, length), size=p, replace=False))
        out.append(
            Sequence(
                ids,
                segments,
                positions,
                rng.integers(5, vocab, size=p),
                int(rng.integers(0, 2)),
                source_index=i,
            )
        )
    return out


def group_into_packs(sequences, s, k):
    packs, current, used = [], [], 0
    for seq in sequences:
        if len(current) == k or used + len(seq.input_ids) > s:
            packs.append(current)
            current, used = [], 0
        current.append(seq)
        used += len(seq.input_ids)
    packs.append(current)
    return packs


def packed_batch(packs, s, k, m, vocab):
    arrays = pack_sequences(packs, s, k, m, vocab)
    return {name: torch.from_numpy(a.astype(np.int64)) for name, a in arrays.items()}


def hf_batch(sequences):
    """Unpacked, right-padded batch with HF's labels (-100 = not masked)."""
    longest = max(len(s.input_ids) for s in sequences)
    n = len(sequences)
    ids = torch.zeros(n, longest, dtype=torch.long)
    seg = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, s in enumerate(sequences):
        length = len(s.input_ids)
        ids[i, :length] = torch.from_numpy(s.input_ids)
        seg[i, :length] = torch.from_numpy(s.segment_ids)
        mask[i, :length] = 1
        labels[i, torch.from_numpy(s.masked_lm_positions)] = torch.from_numpy(s.masked_lm_ids)
    nsp = torch.tensor([s.next_sentence_label for s in sequences])
    return dict(
        input_ids=ids, token_type_ids=seg, attention_mask=mask, labels=labels, next_sentence_label=nsp
    )


def reference_for(model):
    ref = BertForPreTraining(model.config)
    missing, unexpected = ref.load_state_dict(model.state_dict(), strict=False)
    assert set(missing) <= {"cls.predictions.decoder.bias"} and not unexpected
    ref.tie_weights()
    return ref


def _compare_outputs(model, ref, sequences, packs, batch):
    out = model(**batch)
    row_of = {}
    for r, pack in enumerate(packs):
        offset = 0
        for j, seq in enumerate(pack):
            row_of[seq.source_index] = (r, j, offset)
            offset += len(seq.input_ids)
    slot = {}
    for seq in sequences:
        r, j, offset = row_of[seq.source_index]
        length = len(seq.input_ids)
        ids = torch.from_numpy(seq.input_ids)[None]
        seg = torch.from_numpy(seq.segment_ids)[None]
        ref_out = ref(input_ids=ids, token_type_ids=seg, output_hidden_states=True)
        hidden = ref_out.hidden_states[-1][0]
        torch.testing.assert_close(
            out["sequence_output"][r, offset : offset + length], hidden, atol=1e-5, rtol=0
        )
        torch.testing.assert_close(
            out["nsp_logits"][r, j], ref_out.seq_relationship_logits[0], atol=1e-5, rtol=0
        )
        start = slot.get(r, 0)
        p = len(seq.masked_lm_positions)
        torch.testing.assert_close(
            out["mlm_logits"][r, start : start + p],
            ref_out.prediction_logits[0, seq.masked_lm_positions],
            atol=1e-5,
            rtol=1e-5,  # logits of a 30k-way projection, magnitude ~10: fp32 summation order moves them ~1e-5
        )
        slot[r] = start + p
    return out


def bert_config_json(config) -> dict:
    """The checkpoint's bert_config.json, as Google's BERT writes it."""
    return {k: getattr(config, k) for k in CONFIG_KEYS}


def flex_available():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401

        cfg = tiny_config("flex")
        model = PackedBertForPreTraining(cfg).eval()
        seqs = random_sequences(np.random.default_rng(0), 2, VOCAB)
        with torch.no_grad():
            model(**packed_batch(group_into_packs(seqs, S, K), S, K, M, VOCAB))
        return True
    except Exception:  # noqa: BLE001 - any failure means the backend is unusable here
        return False


def tiny_config(backend="dense", **overrides):
    fields = dict(
        vocab_size=VOCAB,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attention_backend=backend,
    )
    fields.update(overrides)
    return bert_config("bert-tiny", **fields)


# the attention backends this machine runs (flex where torch compiles it here)
BACKENDS = ["dense", "sdpa", "varlen"] + (["flex"] if flex_available() else [])


def cosines(a, b):
    """The cosine of each row of a [N, D] with the same row of b [N, D]."""
    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
