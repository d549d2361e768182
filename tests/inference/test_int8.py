"""int8 inference (packed_transformers/inference/int8.py): the arithmetic of one int8 Linear
against a numpy reference, what is quantized and what is not, the real MiniLM's embeddings
within the quality gate against float32 (through the Python API, `packed_encode`, the embed
command and the server's /embed), and the refusal where the CPU has no VNNI.

Where this CPU has no VNNI, int8 is refused, and only the refusal tests run."""

from __future__ import annotations

import json
import warnings

import httpx
import numpy as np
import pytest
import torch

from packed_transformers.commands import embed as embed_command
from packed_transformers.data.assets import corpus_glob, model_dir
from packed_transformers.data.embedding_texts import bbc_articles, texts_of
from packed_transformers.inference import int8
from packed_transformers.inference.embedding import encode, load_encoder, packed_encode
from packed_transformers.inference.options import InferenceOptions

from ..model_helpers import cosines

needs_vnni = pytest.mark.skipif(
    int8.int8_problem("cpu") is not None, reason="this CPU has no VNNI: int8 is refused"
)

# The gate against ONNX Runtime's int8 is measured side by side in bench/bench_onnx.py
# (docs/embeddings.md); here a floor that holds on these texts: a 1-letter text (nearly all
# [CLS] and [SEP]) is the furthest from float32 (0.975 measured; the empty text 0.972).
MIN_COSINE, MEDIAN_COSINE = 0.965, 0.99


def reference_int8_linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """What an int8 Linear computes, written out: weights symmetric per output channel in
    [-127, 127]; the input affine uint8 over [min(x, 0), max(x, 0)] in 255 steps; products
    summed exactly (int64 here, int32 in the kernel), then scaled back, bias added."""
    w_scale = np.abs(weight).max(axis=1) / 127
    w_q = np.round(weight / w_scale[:, None]).astype(np.int64)
    low, high = min(x.min(), 0.0), max(x.max(), 0.0)
    x_scale = (high - low) / 255
    zero = np.clip(np.round(-low / x_scale), 0, 255)
    x_q = np.clip(np.round(x / x_scale) + zero, 0, 255).astype(np.int64)
    summed = (x_q - int(zero)) @ w_q.T
    return (summed * x_scale * w_scale[None, :] + bias).astype(np.float32)


@needs_vnni
def test_an_int8_linear_computes_the_int8_arithmetic_and_stays_near_float():
    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 1536)
    with torch.no_grad():
        linear.weight[3, 7] = 2.0  # one outlier: its channel's scale only, not the others'
    x = torch.randn(2, 40, 384) * 3
    ours = int8.Int8Linear(linear)(x)
    assert ours.shape == (2, 40, 1536) and ours.dtype == torch.float32
    reference = reference_int8_linear(x.reshape(-1, 384).numpy(), linear.weight.detach().numpy(),
                                      linear.bias.detach().numpy()).reshape(2, 40, 1536)  # fmt: skip
    step = float(x.abs().max()) / 255 * float(linear.weight.detach().abs().max()) / 127
    np.testing.assert_allclose(ours.numpy(), reference, rtol=0, atol=8 * step)  # a rounding or two apart
    exact = linear(x).detach()
    relative = float((ours - exact).norm() / exact.norm())
    assert relative < 0.02
    # control: 7-bit activations (the reduce_range torch's own quantized Linear asks for)
    # are measurably further from float32, which is why int8 here uses 8 bits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        seven_bit = torch.ops.quantized.linear_dynamic(x, int8.Int8Linear(linear)._packed, True)
    assert float((seven_bit - exact).norm() / exact.norm()) > 1.5 * relative


@needs_vnni
def test_quantize_encoder_copies_the_model_and_keeps_its_heads_float():
    encoder = load_encoder(model_dir())
    before = {k: v.clone() for k, v in encoder.model.state_dict().items()}
    quantized = int8.quantize_encoder(encoder.model)
    names = {type(m).__name__ for n, m in quantized.named_modules() if ".layer." in f".{n}."}
    assert "Int8Linear" in names and "Linear" not in names
    assert sum(isinstance(m, int8.Int8Linear) for m in quantized.modules()) == 6 * 6  # 6 layers x 6
    assert all(
        isinstance(m, torch.nn.Linear) for m in encoder.model.modules() if "Linear" in type(m).__name__
    )
    after = encoder.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.fixture(scope="module")
def texts():
    """BBC texts of mixed lengths (titles, sentences, paragraphs) and a 1-letter one (the
    commands and the server refuse an empty text)."""
    pool = texts_of(bbc_articles(corpus_glob())[:40], "mixed")
    picks = np.random.default_rng(0).choice(len(pool), size=min(160, len(pool)), replace=False)
    return ["x", *[pool[i] for i in picks]]


@needs_vnni
def test_int8_embeddings_hold_the_quality_gate_in_the_api_and_the_command(texts, tmp_path):
    """The real MiniLM, int8 against float32: per-text cosine min and median above the gate;
    `packed_encode(st_model, texts, dtype="int8")` and `embed --dtype int8` give the API's
    vectors."""
    from sentence_transformers import SentenceTransformer

    encoder = load_encoder(model_dir())
    fp32 = encode(texts, encoder)
    eight = encode(texts, encoder, InferenceOptions.for_embedding(dtype="int8"))
    assert eight.shape == fp32.shape and eight.dtype == np.float32
    similar = cosines(eight, fp32)
    assert similar.min() >= MIN_COSINE and np.median(similar) >= MEDIAN_COSINE, (
        similar.min(),
        np.median(similar),
    )
    assert not np.allclose(eight, fp32, atol=1e-4)  # it did run in int8
    st_model = SentenceTransformer(str(model_dir()), device="cpu")
    np.testing.assert_allclose(packed_encode(st_model, texts, dtype="int8"), eight, atol=1e-6)
    source = tmp_path / "texts.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "int8.npy"
    argv = ["--model", str(model_dir()), "--input", str(source), "--output", str(out), "--dtype", "int8"]
    assert embed_command.main(argv) == 0
    np.testing.assert_allclose(np.load(out), eight, atol=1e-6)


@needs_vnni
@pytest.mark.slow
def test_the_servers_int8_embed_holds_the_gate(texts):
    """/embed from an int8 engine: each answer within the gate of float32's vectors (an int8
    vector depends a little on the batch it ran in: the activations' scale is per forward)."""
    from packed_transformers.serving.engines import load_engine

    from ..servers import Server

    expected = encode(texts, load_encoder(model_dir()))
    engine = load_engine(model_dir(), "cpu", dtype="int8")
    with Server(model_dir(), "packed", engine=engine, max_batch_tokens=512, batch_size=4) as server:
        vectors = []
        for first in range(0, len(texts), 16):
            response = httpx.post(
                server.url + "/embed",
                json={"inputs": texts[first : first + 16], "truncate": True},
                timeout=60,
            )
            assert response.status_code == 200, response.text
            vectors.extend(response.json())
    similar = cosines(np.array(vectors, dtype=np.float32), expected)
    assert similar.min() >= MIN_COSINE and np.median(similar) >= MEDIAN_COSINE


def test_int8_is_refused_in_one_line_without_vnni_or_off_the_cpu(tmp_path, capsys, monkeypatch):
    source = tmp_path / "t.jsonl"
    source.write_text('{"text": "a"}\n')
    out = tmp_path / "o.npy"
    argv = ["--model", str(model_dir()), "--input", str(source), "--output", str(out), "--dtype", "int8"]
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert embed_command.main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert "--dtype int8: this CPU has no VNNI" in error and len(error.splitlines()) == 1
    assert not out.exists()
    from sentence_transformers import SentenceTransformer

    with pytest.raises(ValueError, match="no VNNI"):
        packed_encode(SentenceTransformer(str(model_dir()), device="cpu"), ["a"], dtype="int8")
    assert "not on cuda" in int8.int8_problem("cuda")
