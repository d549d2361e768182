"""Packed question answering against transformers' BertForQuestionAnswering, per window:
start/end logits, the loss and every parameter's gradient (fp32, the real MiniLM-L6
weights, real BBC text cut into overlapping windows), for every attention backend."""

import numpy as np
import pytest
import torch
from transformers import BertForQuestionAnswering

from packed_transformers.components.batches import collate
from packed_transformers.data import assets
from packed_transformers.data.qa_data import QaExamples
from packed_transformers.data.qa_windows import fast_tokenizer, make_windows
from packed_transformers.data.tokenizer import load_tokenizer
from packed_transformers.inference.question_answering import predict_spans
from packed_transformers.model.bert_heads import PackedBertForQuestionAnswering, span_metrics
from packed_transformers.packs.batching import BATCHING_MODES, Batcher, BatchingSpec
from packed_transformers.packs.rows import pack_rows, unpack_token_outputs
from packed_transformers.packs.tokenized import pack_examples

from ..conftest import fast_loop_keeps
from ..model_helpers import BACKENDS

WINDOW, STRIDE, PACK = 80, 24, 160


@pytest.fixture(scope="module")
def reference_folder(tmp_path_factory):
    """MiniLM-L6 with a seeded qa_outputs head, saved as a BertForQuestionAnswering folder."""
    torch.manual_seed(0)
    reference = BertForQuestionAnswering.from_pretrained(assets.model_dir())
    folder = tmp_path_factory.mktemp("minilm_qa")
    reference.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def windows():
    """Questions over real BBC paragraphs; long contexts overflow into several windows."""
    _, vocab = load_tokenizer(assets.vocab_file())
    paragraphs = [
        "Quarterly profits at US media giant TimeWarner jumped 76% to $1.13bn for the three months to "
        "December, from $639m a year earlier. The firm, which is now one of the biggest investors in "
        "Google, benefited from sales of high-speed internet connections and higher advert sales.",
        "The dollar has hit its highest level against the euro in almost three months after the "
        "Federal Reserve head said the US trade deficit is set to stabilise.",
        "Alan Greenspan highlighted the US government's willingness to curb spending and rising "
        "household savings as factors which may help to reduce it. In late trading in New York, the "
        "dollar reached $1.2871 against the euro, from $1.2974 on Thursday.",
    ]
    examples = QaExamples()
    for i, (question, context, answer) in enumerate(
        [
            ("How much did profits jump?", paragraphs[0], "76%"),
            ("Who said the deficit will stabilise?", paragraphs[1], "Federal Reserve head"),
            ("Where did the dollar reach $1.2871?", paragraphs[2], "New York"),
            ("  Which firm invests in Google?", paragraphs[0], "TimeWarner"),
            ("What did the euro do?", paragraphs[1] + " " + paragraphs[2], "Thursday"),
        ]
    ):
        examples.ids.append(str(i))
        examples.questions.append(question)
        examples.contexts.append(context)
        examples.answers.append(([answer], [context.index(answer)]))
        examples.where.append(f"test:{i}")
    out = make_windows(examples, fast_tokenizer(vocab), WINDOW, STRIDE)
    assert len(out) > len(examples)  # some questions really span several windows
    assert (out.labels[:, 0] > 0).any() and (out.labels[:, 0] == 0).any()  # in and out of a window
    return out


def hf_per_window(reference, windows):
    """Each window alone through transformers: logits [L] and the loss with its labels."""
    results = []
    for ids, segments, (start, end) in zip(windows.token_ids, windows.segment_ids, windows.labels):
        out = reference(
            input_ids=torch.from_numpy(ids.astype(np.int64))[None],
            token_type_ids=torch.from_numpy(segments.astype(np.int64))[None],
            start_positions=torch.tensor([start]),
            end_positions=torch.tensor([end]),
        )
        results.append(out)
    return results


@pytest.mark.parametrize("backend", fast_loop_keeps(BACKENDS, ("sdpa", "varlen")))  # ~2.6 s each
def test_packed_qa_logits_loss_and_gradients_equal_transformers_per_window(
    backend, reference_folder, windows
):
    reference = BertForQuestionAnswering.from_pretrained(reference_folder).eval()
    ours = PackedBertForQuestionAnswering.from_pretrained(reference_folder, attention_backend=backend).eval()
    assert not ours.loading_report.get("missing_keys")
    table = pack_examples(windows.lengths, PACK, 3, "lpfhp", seed=1)
    assert len(table) < len(windows)  # really packed
    rows = pack_rows(windows.token_ids, table, PACK, windows.segment_ids)
    batch = {name: torch.from_numpy(value) for name, value in rows.items()}
    labels = windows.labels[np.maximum(table, 0)]
    batch["labels"] = torch.from_numpy(labels)
    # flex attention has no backward on CPU (torch raises): its forward only here, its
    # gradients in tests/model/test_cuda.py.
    with torch.set_grad_enabled(backend != "flex"):
        out = ours(**batch)

    theirs = hf_per_window(reference, windows)
    for name in ("start_logits", "end_logits"):
        got = unpack_token_outputs(
            out[name].detach().numpy(), rows["cls_positions"], rows["example_index"], windows.lengths
        )
        for w, hf in enumerate(theirs):
            expected = getattr(hf, name)[0].detach().numpy()
            np.testing.assert_allclose(got[w, : len(expected)], expected, atol=1e-5, rtol=0)
            assert np.all(np.isneginf(got[w, len(expected) :]))
    hf_loss = torch.stack([hf.loss for hf in theirs]).mean()
    assert float(out["loss"].detach()) == pytest.approx(float(hf_loss.detach()), abs=1e-5)
    assert int(out["count"]) == len(windows)

    if backend == "flex":
        return
    out["loss"].backward()
    hf_loss.backward()
    reference_parameters = dict(reference.named_parameters())
    for name, parameter in ours.named_parameters():
        expected = reference_parameters[name].grad
        scale = max(float(expected.abs().max()), 1.0)
        assert float((parameter.grad - expected).abs().max()) <= 1e-5 * scale, name


def test_loss_ignores_absent_slots_and_other_windows():
    """Garbage in other windows' and padding logits, and in absent slots' labels, changes
    neither a window's loss nor its gradient: each window's softmax is over its own tokens."""
    torch.manual_seed(0)
    sequence_ids = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 0, 0, 0]])
    cls_positions = torch.tensor([[0, 3], [0, 0]])
    present = torch.tensor([[True, True], [True, False]])
    labels = torch.tensor([[[1, 2], [0, 1]], [[3, 3], [99, -7]]])
    start = torch.randn(2, 7, requires_grad=True)
    end = torch.randn(2, 7, requires_grad=True)
    out = span_metrics(start, end, sequence_ids, cls_positions, labels, present)
    out["loss"].backward()
    expected = []
    for row, (first, length), (s, e) in [(0, (0, 3), (1, 2)), (0, (3, 2), (0, 1)), (1, (0, 4), (3, 3))]:
        window_start, window_end = start[row, first : first + length], end[row, first : first + length]
        ce = torch.nn.functional.cross_entropy
        expected.append(
            (ce(window_start[None], torch.tensor([s])) + ce(window_end[None], torch.tensor([e]))) / 2
        )
    assert float(out["loss"]) == pytest.approx(float(torch.stack(expected).mean()), abs=1e-6)
    assert torch.all(start.grad[sequence_ids == 0] == 0)  # padding never enters a softmax
    assert int(out["count"]) == 3


@pytest.mark.parametrize("mode", BATCHING_MODES)
def test_every_batching_mode_gives_the_same_window_logits(mode, reference_folder, windows):
    ours = PackedBertForQuestionAnswering.from_pretrained(reference_folder, attention_backend="sdpa")
    spec = BatchingSpec(mode, batch_size=4, max_sequence_length=WINDOW, max_per_pack=3, pack_length=PACK)
    start, end, timing = predict_spans(ours, windows, Batcher(windows.lengths, spec, seed=2))
    spec = BatchingSpec("dynamic", batch_size=1, max_sequence_length=WINDOW)
    start_one, end_one, _ = predict_spans(ours, windows, Batcher(windows.lengths, spec, seed=0))
    np.testing.assert_allclose(start, start_one, atol=1e-5, rtol=0)
    np.testing.assert_allclose(end, end_one, atol=1e-5, rtol=0)
    assert timing["examples"] == len(windows)


def test_collate_moves_span_labels_with_their_windows(windows):
    table = pack_examples(windows.lengths, PACK, 3, "spfhp", seed=4)
    batch = collate(windows, table, PACK)
    for row, slots in enumerate(table):
        for slot, w in enumerate(slots):
            if w < 0:
                continue
            start, end = batch["labels"][row, slot].tolist()
            first = int(batch["cls_positions"][row, slot])
            ids = batch["input_ids"][row].numpy()
            # The labelled tokens of the row are the window's labelled tokens.
            assert ids[first + start] == windows.token_ids[w][start]
            assert ids[first + end] == windows.token_ids[w][end]
            assert batch["labels"].dtype == torch.int64
