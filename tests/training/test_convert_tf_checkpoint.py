"""The TF1 starting-checkpoint converter, judged by TensorFlow and transformers.

A random BertForPreTraining (transformers) is written as a TF1 checkpoint under the names of
Google's/MLPerf's BERT (`bert/encoder/layer_0/attention/self/query/kernel`, ...), with Adam
slots and a global step as the MLPerf checkpoint has them, by TensorFlow itself (SaveV2, in
the optional .venv-tf environment: `make install-tf`). The converted folder must give the
original model's outputs, in transformers and in our packed model via model.init_checkpoint.
Skipped where .venv-tf is absent (CI builds it: `make test` depends on `install-tf`).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from packed_transformers.data.convert_tf_checkpoint import CONFIG_KEYS
from packed_transformers.data.convert_tf_checkpoint import main as convert_main

from ..model_helpers import bert_config_json  # noqa: F401

# End to end (whole runs, subprocesses): `pytest -m "not slow"` leaves them out.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TF_PYTHON = ROOT / ".venv-tf" / "bin" / "python"

SAVE_SCRIPT = """
import sys, numpy as np, tensorflow as tf
arrays = np.load(sys.argv[1])
names = sorted(arrays.files)
tf.raw_ops.SaveV2(prefix=sys.argv[2], tensor_names=names, shape_and_slices=[""] * len(names),
                  tensors=[tf.constant(arrays[n]) for n in names])
"""


def tf1_variables(model) -> dict[str, np.ndarray]:
    """The HF model's weights under Google BERT's TF1 names (dense kernels are [in, out])."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    out = {
        "bert/embeddings/word_embeddings": sd["bert.embeddings.word_embeddings.weight"],
        "bert/embeddings/position_embeddings": sd["bert.embeddings.position_embeddings.weight"],
        "bert/embeddings/token_type_embeddings": sd["bert.embeddings.token_type_embeddings.weight"],
        "bert/embeddings/LayerNorm/gamma": sd["bert.embeddings.LayerNorm.weight"],
        "bert/embeddings/LayerNorm/beta": sd["bert.embeddings.LayerNorm.bias"],
        "bert/pooler/dense/kernel": sd["bert.pooler.dense.weight"].T,
        "bert/pooler/dense/bias": sd["bert.pooler.dense.bias"],
        "cls/predictions/transform/dense/kernel": sd["cls.predictions.transform.dense.weight"].T,
        "cls/predictions/transform/dense/bias": sd["cls.predictions.transform.dense.bias"],
        "cls/predictions/transform/LayerNorm/gamma": sd["cls.predictions.transform.LayerNorm.weight"],
        "cls/predictions/transform/LayerNorm/beta": sd["cls.predictions.transform.LayerNorm.bias"],
        "cls/predictions/output_bias": sd["cls.predictions.bias"],
        "cls/seq_relationship/output_weights": sd["cls.seq_relationship.weight"],
        "cls/seq_relationship/output_bias": sd["cls.seq_relationship.bias"],
    }
    for i in range(model.config.num_hidden_layers):
        hf, tf = f"bert.encoder.layer.{i}.", f"bert/encoder/layer_{i}/"
        for tf_module, hf_module in [
            ("attention/self/query", "attention.self.query"),
            ("attention/self/key", "attention.self.key"),
            ("attention/self/value", "attention.self.value"),
            ("attention/output/dense", "attention.output.dense"),
            ("intermediate/dense", "intermediate.dense"),
            ("output/dense", "output.dense"),
        ]:
            out[f"{tf}{tf_module}/kernel"] = sd[f"{hf}{hf_module}.weight"].T
            out[f"{tf}{tf_module}/bias"] = sd[f"{hf}{hf_module}.bias"]
        for tf_module, hf_module in [
            ("attention/output/LayerNorm", "attention.output.LayerNorm"),
            ("output/LayerNorm", "output.LayerNorm"),
        ]:
            out[f"{tf}{tf_module}/gamma"] = sd[f"{hf}{hf_module}.weight"]
            out[f"{tf}{tf_module}/beta"] = sd[f"{hf}{hf_module}.bias"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def tf_checkpoint(tmp_path_factory):
    if not TF_PYTHON.exists():
        pytest.skip("no .venv-tf (make install-tf): TensorFlow is optional")
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        type_vocab_size=2,
    )
    model = BertForPreTraining(config).eval()
    with torch.no_grad():  # random, non-trivial LayerNorm and bias values
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("tf1")
    variables = tf1_variables(model)
    for name, value in list(variables.items()):
        variables[f"{name}/adam_m"] = np.zeros_like(value)  # the optimizer slots MLPerf's has
        variables[f"{name}/adam_v"] = np.ones_like(value)
    variables["global_step"] = np.array(28252, np.int64)
    np.savez(folder / "vars.npz", **variables)
    subprocess.run(
        [str(TF_PYTHON), "-c", SAVE_SCRIPT, str(folder / "vars.npz"), str(folder / "model.ckpt-28252")],
        check=True,
    )
    (folder / "bert_config.json").write_text(json.dumps(bert_config_json(config)))
    return model, folder, len(variables)


def _convert(folder, out, *extra):
    argv = [
        "--checkpoint",
        str(folder / "model.ckpt-28252"),
        "--bert-config",
        str(folder / "bert_config.json"),
        "--output",
        str(out),
        *extra,
    ]
    return subprocess.run(
        [str(TF_PYTHON), "-m", "packed_transformers.data.convert_tf_checkpoint", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


def test_converted_model_equals_the_original(tf_checkpoint, tmp_path):
    from transformers import BertForPreTraining

    model, folder, n_variables = tf_checkpoint
    result = _convert(folder, tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    n_layers = model.config.num_hidden_layers
    assert report["mapped"] == 14 + 16 * n_layers
    assert report["skipped"] == n_variables - report["mapped"]  # every slot and global_step counted
    converted = BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 120, (3, 20))
    types = torch.randint(0, 2, (3, 20))
    mask = torch.ones(3, 20, dtype=torch.long)
    with torch.no_grad():
        a, b = model(ids, mask, types), converted(ids, mask, types)
    torch.testing.assert_close(b.prediction_logits, a.prediction_logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(b.seq_relationship_logits, a.seq_relationship_logits, rtol=0, atol=1e-6)

    # ... and as model.init_checkpoint of the packed model: one sequence per pack = unpacked BERT.
    from packed_transformers.model.pretraining import PackedBertForPreTraining

    packed = PackedBertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    sd_packed = packed.state_dict()
    shared = [name for name in converted.state_dict() if name in sd_packed]
    assert len(shared) >= report["mapped"]
    for name in shared:
        torch.testing.assert_close(sd_packed[name], converted.state_dict()[name], rtol=0, atol=0)


def test_unknown_and_missing_names_are_listed(tf_checkpoint, tmp_path):
    model, folder, _ = tf_checkpoint
    config = json.loads((folder / "bert_config.json").read_text())
    bad = tmp_path / "bad_config.json"
    bad.write_text(json.dumps({**config, "num_hidden_layers": 3}))
    result = _convert(folder, tmp_path / "x", "--bert-config", str(bad))
    assert result.returncode == 2 and "lacks" in result.stderr and "layer.2" in result.stderr
    assert not (tmp_path / "x").exists()


def test_unknown_tf_names_are_an_error():
    from packed_transformers.data.convert_tf_checkpoint import ConversionError, convert

    config = {
        "num_hidden_layers": 0,
        "hidden_size": 2,
        "vocab_size": 3,
        "intermediate_size": 4,
        "max_position_embeddings": 5,
        "type_vocab_size": 2,
    }
    with pytest.raises(ConversionError, match="bert/encoder/layer_0/attention/self/qkv/kernel"):
        convert({"bert/encoder/layer_0/attention/self/qkv/kernel": np.zeros((2, 6))}, config, "tf")


def test_nvidia_pytorch_form(tmp_path):
    """NVIDIA's converted form: {"model": state_dict} with HF-like names, loaded weights-only."""
    from transformers import BertConfig, BertForPreTraining

    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=32,
    )
    model = BertForPreTraining(config).eval()
    torch.save({"model": {f"module.{k}": v for k, v in model.state_dict().items()}}, tmp_path / "ckpt.pt")
    (tmp_path / "bert_config.json").write_text(json.dumps(bert_config_json(config)))
    argv = [
        "--from",
        "nvidia-pt",
        "--checkpoint",
        str(tmp_path / "ckpt.pt"),
        "--bert-config",
        str(tmp_path / "bert_config.json"),
        "--output",
        str(tmp_path / "hf"),
    ]
    assert convert_main(argv) == 0
    converted = BertForPreTraining.from_pretrained(tmp_path / "hf")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(converted.state_dict()[name], value, rtol=0, atol=0)
    # A pickled object that is not plain tensors is refused, never run.
    torch.save({"model": {"x": object()}}, tmp_path / "evil.pt")
    argv[3] = str(tmp_path / "evil.pt")
    argv[-1] = str(tmp_path / "hf2")
    assert convert_main(argv) == 2 and not (tmp_path / "hf2").exists()


def test_extra_layers_and_any_wrong_shape_are_refused_without_tensorflow():
    """Issue 34 #2: a 3-layer checkpoint with a 2-layer config is refused (it converted,
    dropping a layer); a [64, 32] query kernel is refused at conversion, not at training."""
    from transformers import BertConfig, BertForPreTraining

    from packed_transformers.data.convert_tf_checkpoint import ConversionError, convert

    torch.manual_seed(0)
    config = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                        intermediate_size=48, max_position_embeddings=16)  # fmt: skip
    variables = tf1_variables(BertForPreTraining(config))
    as_dict = {key: getattr(config, key) for key in CONFIG_KEYS}
    convert(variables, as_dict, "tf")  # the matching config converts
    with pytest.raises(ConversionError, match="layer.2"):
        convert(variables, {**as_dict, "num_hidden_layers": 2}, "tf")
    wrong = dict(variables)
    wrong["bert/encoder/layer_0/attention/self/query/kernel"] = np.zeros((64, 32), dtype=np.float32)
    with pytest.raises(ConversionError, match="attention.self.query.weight: shape"):
        convert(wrong, as_dict, "tf")
