"""`--runtime auto` (inference/runtime_choice.py): the CPU kind read from its flags, the measured
table's runtime where OpenVINO can run the job and torch with the reason where it cannot, and
the doors (embed, predict, the server, the Python API) running what it chose."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from packed_transformers.inference import runtime_choice
from packed_transformers.inference.runtime_choice import (
    RUNTIME_TABLE,
    CpuKind,
    choose_runtime,
    cpu_kind,
    this_cpu_kind,
)

from ..conftest import REPO
from ..finetune_helpers import WORDS

AVX2_EPYC = "fpu sse sse2 avx avx2 fma bmi2"
AVX512_EPYC = AVX2_EPYC + " avx512f avx512bw avx512_vnni avx512_bf16"
SAPPHIRE_RAPIDS = AVX512_EPYC + " amx_bf16 amx_tile amx_int8"


@pytest.mark.parametrize(
    "flags, kind",
    [
        (AVX2_EPYC, CpuKind.AVX2),
        (AVX512_EPYC, CpuKind.AVX512_VNNI),
        (SAPPHIRE_RAPIDS, CpuKind.AMX),
        ("fpu sse sse2 avx512f", CpuKind.OTHER),
        ("fpu sse sse2 neon", CpuKind.OTHER),
    ],  # fmt: skip
)
def test_the_cpu_kind_is_read_from_its_flags(flags, kind, tmp_path):
    assert cpu_kind(frozenset(flags.split())) is kind
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    )
    assert this_cpu_kind(cpuinfo) is kind  # the first processor's flags
    assert this_cpu_kind(tmp_path / "absent") is CpuKind.OTHER


def test_the_table_picks_a_graph_runtime_only_where_it_was_measured_and_runs_the_dtype():
    """Every graph-runtime row cites the docs section that holds its figures, and none picks
    OpenVINO's int8 on a kind without VNNI (refused there: below the quality gate)."""
    docs = (REPO / "docs/embeddings.md").read_text()
    for (kind, dtype), measured in RUNTIME_TABLE.items():
        assert measured.runtime in ("torch", "openvino", "onnxruntime") and dtype in ("float32", "int8")
        if measured.runtime == "openvino" and dtype == "int8":
            assert kind in (CpuKind.AVX512_VNNI, CpuKind.AMX)
        if measured.runtime != "torch":
            assert measured.section and f"\n### {measured.section}\n" in docs, measured.section


@pytest.mark.parametrize(
    "settings, runtime, reason",
    [
        ({"kind": CpuKind.AVX512_VNNI, "dtype": "float32"}, "openvino", "AVX-512 with VNNI, float32"),
        ({"kind": CpuKind.AVX512_VNNI, "dtype": "int8", "task": "classification"}, "openvino", "int8"),
        ({"kind": CpuKind.AVX2, "dtype": "float32"}, "torch", "ONNX Runtime on packed rows ran the process at 0.96x"),
        ({"kind": CpuKind.AVX2, "dtype": "int8"}, "onnxruntime", "AVX2 without AVX-512, int8: its dynamic int8"),
        ({"kind": CpuKind.AVX2, "dtype": "int8", "installed": frozenset({"openvino"})}, "torch",
         "onnxruntime, measured faster on AVX2 without AVX-512, is not installed"),
        ({"kind": CpuKind.AMX, "dtype": "int8"}, "openvino", "AMX (Xeon 4th generation and later), int8: 1.20x"),
        ({"kind": CpuKind.AMX, "dtype": "float32"}, "openvino", "1.03-1.07x torch as whole processes in every round"),
        ({"kind": CpuKind.OTHER, "dtype": "float32"}, "torch", "not measured"),
        ({"kind": CpuKind.AVX512_VNNI, "dtype": "bfloat16"}, "torch", "bfloat16: not measured"),
        ({"kind": CpuKind.AVX512_VNNI, "dtype": "float32", "task": "question_answering"}, "torch",
         "the graph runtimes run classification and embedding folders, not question_answering"),
        ({"kind": CpuKind.AVX512_VNNI, "dtype": "float32", "device": "cuda"}, "torch", "the device is cuda"),
        ({"kind": CpuKind.AVX512_VNNI, "dtype": "float32", "ray": True}, "torch", "Ray's replicas run torch"),
        ({"kind": CpuKind.AVX512_VNNI, "dtype": "float32", "compiled": True}, "torch", "--compile"),
        ({"kind": CpuKind.AVX512_VNNI, "dtype": "float32", "installed": frozenset({"onnxruntime"})}, "torch",
         "openvino, measured faster on AVX-512 with VNNI, is not installed"),
        ({"kind": CpuKind.AVX512_VNNI, "dtype": "int8", "serving": True}, "torch", "the server runs torch"),
        ({"kind": CpuKind.AVX512_VNNI, "dtype": "float32", "serving": True}, "torch", "0.73x"),
        ({"kind": CpuKind.AMX, "dtype": "float32", "serving": True}, "openvino", "served /embed at 1.08x torch's rate"),
        ({"kind": CpuKind.AMX, "dtype": "int8", "serving": True}, "torch", "the server runs torch"),
    ],
)  # fmt: skip
def test_auto_runs_the_tables_runtime_or_says_why_torch(settings, runtime, reason):
    settings = {"task": "embedding", **settings}
    kind, dtype, task = settings.pop("kind"), settings.pop("dtype"), settings.pop("task")
    choice = choose_runtime(kind, dtype, task, **settings)
    assert choice.runtime == runtime and choice.why.startswith(f"--runtime auto: {runtime} (")
    assert reason in choice.why


def tiny_texts(n: int) -> list[str]:
    rng = np.random.default_rng(7)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 30)))) for _ in range(n)]


@pytest.fixture
def kind_of_cpu(monkeypatch, tmp_path_factory):
    """Sets the kind auto sees (the machine under test may be any), graphs cached in the session's temporary folder."""
    monkeypatch.setenv("PACKED_TRANSFORMERS_CACHE", str(tmp_path_factory.getbasetemp() / "openvino-cache"))

    def set_kind(kind: CpuKind) -> None:
        monkeypatch.setattr(runtime_choice, "this_cpu_kind", lambda: kind)

    return set_kind


def test_the_commands_run_what_auto_chose_and_say_so(checkpoint, trained, tmp_path, capsys, kind_of_cpu):
    pytest.importorskip("openvino")
    from packed_transformers.commands import embed as embed_command
    from packed_transformers.commands import predict as predict_command

    texts = tiny_texts(20)
    source = tmp_path / "texts.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    def embed(runtime: str, out: Path) -> dict:
        argv = ["--model", str(checkpoint), "--pooling", "mean", "--input", str(source), "--output", str(out),
                "--runtime", runtime, "--batch-size", "8", "--quiet"]  # fmt: skip
        assert embed_command.main(argv) == 0
        captured = capsys.readouterr()
        return {"summary": json.loads(captured.out.strip().splitlines()[-1]), "stderr": captured.err}

    reference = embed("torch", tmp_path / "torch.npy")
    assert "--runtime auto" not in reference["stderr"]
    kind_of_cpu(CpuKind.AVX512_VNNI)
    chosen = embed("auto", tmp_path / "auto.npy")
    assert chosen["summary"]["runtime"] == "openvino"
    assert "--runtime auto: openvino (AVX-512 with VNNI, float32" in chosen["stderr"]
    np.testing.assert_allclose(
        np.load(tmp_path / "auto.npy"), np.load(tmp_path / "torch.npy"), rtol=0, atol=2e-5
    )
    kind_of_cpu(CpuKind.AVX2)
    assert embed("auto", tmp_path / "avx2.npy")["summary"]["runtime"] == "torch"
    assert np.array_equal(np.load(tmp_path / "avx2.npy"), np.load(tmp_path / "torch.npy"))

    # predict: a classification folder through OpenVINO where the table says so, its scores torch's
    model, validation = trained / "run" / "model", trained / "val.jsonl"
    outputs = {}
    for runtime, kind in (("torch", CpuKind.AVX2), ("auto", CpuKind.AVX512_VNNI)):
        kind_of_cpu(kind)
        out = tmp_path / f"predict_{runtime}.jsonl"
        assert predict_command.main(["--model", str(model), "--input", str(validation), "--output", str(out)]
                                    + ["--runtime", runtime]) == 0  # fmt: skip
        outputs[runtime] = [json.loads(line) for line in out.read_text().splitlines()]
        summary = json.loads(out.with_suffix(".summary.json").read_text())
        assert summary["runtime"] == ("openvino" if runtime == "auto" else "torch")
    assert "--runtime auto: openvino (AVX-512 with VNNI, float32" in capsys.readouterr().err
    assert [r["label"] for r in outputs["auto"]] == [r["label"] for r in outputs["torch"]]
    for auto, torch_record in zip(outputs["auto"], outputs["torch"]):
        for label, score in torch_record["scores"].items():
            assert abs(auto["scores"][label] - score) <= 1e-4


def test_the_server_and_the_api_resolve_auto_for_their_folder(checkpoint, kind_of_cpu):
    pytest.importorskip("openvino")
    from packed_transformers.inference.embedding import encode, load_encoder
    from packed_transformers.inference.options import InferenceOptions
    from packed_transformers.inference.runner import runner_of
    from packed_transformers.serving.engines import load_engine

    kind_of_cpu(CpuKind.AVX512_VNNI)  # where batch jobs run OpenVINO, the server runs torch (measured)
    engine = load_engine(checkpoint, pooling=["mean"], runtime="auto")
    assert (
        engine.runner.runtime == "torch"
        and "--runtime auto: torch (the server runs torch" in engine.runtime_chosen
    )
    assert load_engine(checkpoint, pooling=["mean"], runtime="openvino").runner.runtime == "openvino"
    assert load_engine(checkpoint, pooling=["mean"], runtime="torch").runtime_chosen == ""
    # the API: options.runtime "auto" runs the chosen runner, kept on the encoder under the choice
    encoder = load_encoder(checkpoint, pooling=["mean"])
    texts = tiny_texts(6)
    vectors = encode(texts, encoder, InferenceOptions.for_embedding(runtime="auto"))
    assert runner_of(encoder, "cpu", "float32", False, "auto") is runner_of(
        encoder, "cpu", "float32", False, "openvino"
    )
    np.testing.assert_allclose(
        vectors, encode(texts, encoder, InferenceOptions.for_embedding()), rtol=0, atol=2e-5
    )
    kind_of_cpu(CpuKind.OTHER)
    assert runner_of(encoder, "cpu", "float32", False, "auto").runtime == "torch"
