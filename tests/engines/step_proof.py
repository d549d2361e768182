"""The proof that one step changed no job (issue 95): every training job through every engine it
runs on, run as its users run it (its command in a process of its own, torchrun for 2 ranks),
and what it wrote read back: each logged line's numbers (the loss of every step; fine-tuning's
lines per epoch) and a digest of the final weights (each tensor's sum, L2 norm and first 8
values).

    python tests/engines/step_proof.py OUT.json [JOB ...]

writes this checkout's figures. tests/engines/data/step_proof_5b4a0cd_KIND.json holds the figures
of the code before issue 95's change (5b4a0cd: three step implementations) on a CPU kind (avx2,
avx512, amx: test_step_proof.cpu_kind), made by this file copied into that checkout (it imports
only packed_transformers and the libraries, and writes the config keys that code knows):

    git worktree add /tmp/before 5b4a0cd
    cp tests/engines/step_proof.py /tmp/before/tests/training/
    cd /tmp/before && PYTHONPATH=. python tests/training/step_proof.py step_proof_5b4a0cd_KIND.json

tests/engines/test_step_proof.py runs the jobs again with this code and compares (1e-5).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
S, P, VOCAB = 64, 10, 1200  # the packed BERT set's sequence length, predictions, vocabulary
WORDS = "the a market shares profit bank film music award star match goal team win game vote party".split()
TOPICS = ([["market", "shares", "profit", "bank"], ["film", "music", "award", "star"],
          ["match", "goal", "team", "win"]])  # fmt: skip
CLASSES = ["business", "culture", "sport"]
# figures a run's speed decides (not its arithmetic): not compared
TIMING = re.compile(r"second|time|throughput|per_s|_ms|elapsed|memory|date|_at$")


@dataclass(frozen=True)
class ProofJob:
    """One job on one engine: the command's kind, its config's sections and its processes."""

    name: str
    kind: str  # bert | decoder | finetune
    data: str  # the inputs it reads (make_inputs' names)
    sections: dict
    processes: int = 1


def _pretraining(accumulation: int, **execution) -> dict:
    """A pretraining job's sections: CPU, one thread a process, `accumulation` micro-batches a step."""
    return {
        "execution": {"device": "cpu", "threads": 1, **execution},
        "optim": {"gradient_accumulation": accumulation},
    }


NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
JOBS = (
    ProofJob("bert_torch", "bert", "packed", _pretraining(2)),
    ProofJob("bert_ddp", "bert", "packed", _pretraining(1), 2),
    ProofJob("bert_fsdp2", "bert", "packed", _pretraining(1, sharding="fsdp"), 2),
    ProofJob("bert_pipeline", "bert", "packed", _pretraining(2, layers_per_stage=[1, 1], pipeline_schedule="1f1b"), 2),
    ProofJob("decoder_torch", "decoder", "rows", _pretraining(2)),
    ProofJob("decoder_ddp", "decoder", "rows", _pretraining(1), 2),
    ProofJob("decoder_fsdp2", "decoder", "rows", _pretraining(1, sharding="fsdp"), 2),
    ProofJob("classification_torch", "finetune", "classification", {}),
    ProofJob("classification_ddp", "finetune", "classification", {}, 2),
    ProofJob("classification_fsdp2", "finetune", "classification", {"sharding": "fsdp"}, 2),
    ProofJob("multilabel_torch", "finetune", "multilabel", {}),
    ProofJob("qa_torch", "finetune", "qa", {}),
    ProofJob("sft_torch", "finetune", "sft", {}),
)  # fmt: skip


# --------------------------------------------------------------------------------------
# Inputs: written by this file alone, the same in every checkout
# --------------------------------------------------------------------------------------
def make_inputs(root: Path, needed: set[str]) -> dict[str, Path]:
    """The inputs the jobs in `needed` read, under `root`."""
    made = {}
    if "packed" in needed:
        made["packed"] = _packed_bert(root / "packed")
    if "rows" in needed:
        made["rows"] = _decoder_rows(root / "rows")
    if needed & {"classification", "multilabel"}:
        made["tiny_bert"] = _tiny_bert(
            root / "tiny_bert", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
        )
        for name, n, seed in (("train", 96, 0), ("val", 24, 1)):
            _topic_lines(root / f"{name}.jsonl", n, seed, lambda c: CLASSES[c])
            _topic_lines(
                root / f"{name}-multi.jsonl",
                n,
                seed,
                lambda c: [CLASSES[c]] + (["culture"] if c == 2 else []),
            )
    if "qa" in needed:
        made["qa"] = _qa_files(root / "qa")
    if "sft" in needed:
        made["sft"] = _sft_start(root / "sft")
    return made


def _packed_bert(root: Path) -> Path:
    from packed_transformers.data.synthetic import synthetic_rows
    from packed_transformers.packing.pipeline import PackJob, run_pack
    from packed_transformers.packs.unpacked_hdf5 import write_unpacked_shard

    rng = np.random.default_rng(5)
    for name, n in (("train", 400), ("eval", 60)):
        rows = synthetic_rows(rng.integers(5, S + 1, size=n), S, P, rng, vocab_size=VOCAB)
        (root / f"raw-{name}").mkdir(parents=True)
        write_unpacked_shard(root / f"raw-{name}" / "part-00000.h5", rows)
        run_pack(PackJob(inputs=(str(root / f"raw-{name}" / "part-00000.h5"),), output=str(root / name),
                         algorithm="lpfhp", max_sequences_per_pack=3, max_sequence_length=S,
                         max_predictions_per_seq=P, seed=1, shard_size=100, vocab_size=VOCAB), quiet=True)  # fmt: skip
    return root


def _decoder_rows(root: Path) -> Path:
    from packed_transformers.packs.lm_rows.layouts import document_rows
    from packed_transformers.packs.lm_rows.store import write_rows

    for role, seed in (("train", 0), ("eval", 1)):
        rng = np.random.default_rng(seed)
        tokens = [rng.integers(1, 50, n).astype(np.int32) for n in (5, 9, 30, 3, 12, 40, 7, 7, 20, 11) * 4]
        write_rows(
            root / role,
            document_rows(tokens, 32, depth=None),
            50,
            0,
            {"role": role, "documents_in": len(tokens)},
        )
    return root


def _tiny_bert(folder: Path, vocab: list[str]) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    folder.mkdir(parents=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)  # fmt: skip
    BertModel(config).save_pretrained(folder)
    return folder


def _topic_lines(path: Path, n: int, seed: int, label_of) -> None:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        c = int(rng.integers(0, 3))
        words = list(rng.choice(TOPICS[c], size=int(rng.integers(1, 4)))) + list(
            rng.choice(["the", "a"], size=int(rng.integers(0, 20)))
        )
        record = {"text": " ".join(words), "label": label_of(c)}
        if rng.random() < 0.5:
            record["text_pair"] = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 8))))
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")


def _qa_files(folder: Path) -> Path:
    """Cloze questions over 40 BBC articles (the shipped corpus) and a tiny BERT over the real vocabulary."""
    import glob

    from packed_transformers.data import assets
    from packed_transformers.data.qa_cloze import build, official_layout

    files = [Path(f) for f in sorted(glob.glob(assets.corpus_glob()))[::54]]
    train, dev, _ = build(files, seed=3, per_article=2, dev_fraction=0.3)
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(q) + "\n" for q in train))
    (folder / "dev.json").write_text(json.dumps(official_layout(dev)))
    _tiny_bert(folder / "start", assets.vocab_file().read_text(encoding="utf-8").splitlines())
    return folder


def _sft_start(folder: Path) -> Path:
    """A tiny Qwen2 causal LM with a byte-level tokenizer without merges (no tokenizer learned:
    the same in every process) and prompt/completion lines."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", *sorted(alphabet)])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   model_max_length=128)  # fmt: skip
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(vocab) + 8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(folder / "start")
    fast.save_pretrained(folder / "start")
    rng = np.random.default_rng(0)
    for name, n in (("train", 32), ("val", 8)):
        lines = []
        for _ in range(n):
            prompt = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 8))))
            completion = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 6))))
            lines.append(json.dumps({"prompt": prompt, "completion": completion}))
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


# --------------------------------------------------------------------------------------
# Configs: the keys of the checkout this file runs in
# --------------------------------------------------------------------------------------
def _one_name_keys() -> bool:
    """Whether fine-tuning's device and sharding keys are execution.* here (after issue 95)."""
    from packed_transformers.common import config_schema

    return "training.sharding" in getattr(config_schema, "MOVED", {})


def _merge(config: dict, sections: dict) -> dict:
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return config


def config_of(job: ProofJob, inputs: dict[str, Path], root: Path) -> dict:
    if job.kind == "bert":
        packed = inputs["packed"]
        config = {
            "model": {"preset": "bert-tiny", "vocab_size": VOCAB, "attention_backend": "sdpa"},
            "data": {"train_dir": str(packed / "train"), "eval_dir": str(packed / "eval"), "micro_batch_packs": 4,
                     "loader_workers": 0, "max_sequence_length": S},
            "optim": {"lr": 0.01, "warmup_samples": 0, "total_samples": 100000, "packing_adjustment": "none"},
            "training": {"max_steps": 4, "log_every_steps": 1, "seed": 3},
            "eval": {"every_samples": 10**9, "max_sequences": 60, "at_end": True},
            "logging": {"progress": False, "tensorboard": False, "mlperf": False},
        }  # fmt: skip
        return _merge(config, job.sections)
    if job.kind == "decoder":
        rows = inputs["rows"]
        config = {
            "model": {"family": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                      "num_attention_heads": 4, "num_key_value_heads": 2},
            "data": {"train_dir": str(rows / "train"), "eval_dir": str(rows / "eval"), "max_sequence_length": 32,
                     "micro_batch_rows": 1},
            "optim": {"lr": 0.004, "end_lr": 0.0004, "warmup_samples": 4},
            "training": {"max_steps": 3, "log_every_steps": 1},
            "eval": {"every_samples": 4, "rows": 2},
            "logging": {"submission_division": "open"},
        }  # fmt: skip
        return _merge(config, job.sections)
    execution = {}
    if job.sections.get("sharding"):
        execution = {"sharding": job.sections["sharding"]}
    if job.data in ("classification", "multilabel"):
        suffix = "-multi" if job.data == "multilabel" else ""
        config = {
            "model": {"init_checkpoint": str(inputs["tiny_bert"]), **NO_DROPOUT, "classifier_dropout": 0.0},
            "data": {"source": "jsonl", "train_file": str(root / f"train{suffix}.jsonl"),
                     "validation_file": str(root / f"val{suffix}.jsonl"), "max_sequence_length": 32},
            "batching": {"batch_size": 12, "max_sequences_per_pack": 4},
            "optim": {"lr": 3e-3},
            "training": {"epochs": 2, "progress": False},
        }  # fmt: skip
        if job.data == "multilabel":
            config["data"].update(multi_label=True, labels=CLASSES)
    elif job.data == "qa":
        qa = inputs["qa"]
        config = {
            "model": {"init_checkpoint": str(qa / "start"), "attention_backend": "sdpa", **NO_DROPOUT},
            "data": {"task": "question_answering", "source": "squad", "train_file": str(qa / "train.jsonl"),
                     "validation_file": str(qa / "dev.json"), "max_sequence_length": 96},
            "qa": {"doc_stride": 32},
            "batching": {"mode": "packed", "batch_size": 16, "max_sequences_per_pack": 3, "pack_length": 192},
            "optim": {"lr": 1e-3},
            "training": {"epochs": 1, "progress": False},
        }  # fmt: skip
    else:
        sft = inputs["sft"]
        config = {
            "model": {"init_checkpoint": str(sft / "start"), **NO_DROPOUT},
            "data": {"task": "causal_lm", "train_file": str(sft / "train.jsonl"),
                     "validation_file": str(sft / "val.jsonl"), "max_sequence_length": 64},
            "batching": {"batch_size": 8, "eval_batch_size": 8, "max_sequences_per_pack": 4, "pack_length": 96},
            "optim": {"lr": 3e-3, "warmup_fraction": 0.0},
            "training": {"epochs": 2, "progress": False},
        }  # fmt: skip
    if execution:
        _merge(config, {"execution" if _one_name_keys() else "training": execution})
    return config


# --------------------------------------------------------------------------------------
# Runs and what they wrote
# --------------------------------------------------------------------------------------
def run_job(job: ProofJob, inputs: dict[str, Path], root: Path) -> dict:
    """The job's command in a process of its own -> its figures (`figures_of`)."""
    import yaml

    folder = root / job.name
    folder.mkdir()
    config_path = folder / "config.yaml"
    config_path.write_text(yaml.safe_dump(config_of(job, inputs, root)))
    command = (
        ["run_pretraining.py"] if job.kind != "finetune" else ["-m", "packed_transformers.finetune.train"]
    )
    if job.processes > 1:
        command = [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(job.processes),
            *command,
        ]
    command = [sys.executable, *command, "--config", str(config_path), "--output-dir", str(folder / "out")]
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{job.name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return figures_of(job, folder / "out")


def figures_of(job: ProofJob, output: Path) -> dict:
    """{"lines": each metrics.jsonl line's numbers but timings, "weights": {tensor: [sum, L2
    norm, first 8 values]}} of the final weights (pretraining: the newest checkpoint's model;
    fine-tuning: the fine-tuned folder)."""
    from safetensors.torch import load_file

    lines = []
    for line in (output / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        lines.append({k: v for k, v in record.items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool) and not TIMING.search(k)})  # fmt: skip
    if job.kind == "finetune":
        weights_file = output / "model" / "model.safetensors"
    else:
        weights_file = sorted((output / "checkpoints").glob("step-*"))[-1] / "model" / "model.safetensors"
    weights = {}
    for name, tensor in sorted(load_file(str(weights_file)).items()):
        values = tensor.double().flatten()
        weights[name] = [float(values.sum()), float(values.norm()), [float(v) for v in values[:8]]]
    return {"lines": lines, "weights": weights}


def differences(reference: dict, figures: dict, tolerance: float = 1e-5) -> list[str]:
    """What differs by more than `tolerance` (relative to a figure's size, at least 1) between
    two runs' figures: each a line naming the line, key or tensor."""
    found = []

    def close(a: float, b: float) -> bool:
        return abs(a - b) <= tolerance * max(1.0, abs(a))

    if len(reference["lines"]) != len(figures["lines"]):
        found.append(f"{len(figures['lines'])} metrics lines, {len(reference['lines'])} before")
    for i, (was, now) in enumerate(zip(reference["lines"], figures["lines"])):
        for key in sorted(set(was) & set(now)):
            if not close(was[key], now[key]):
                found.append(f"metrics line {i} {key}: {now[key]} (before: {was[key]})")
    if set(reference["weights"]) != set(figures["weights"]):
        found.append(
            f"weights' names differ: {sorted(set(reference['weights']) ^ set(figures['weights']))[:4]}"
        )
    for name in sorted(set(reference["weights"]) & set(figures["weights"])):
        (sum_was, norm_was, first_was), (sum_now, norm_now, first_now) = (
            reference["weights"][name],
            figures["weights"][name],
        )
        values_close = all(abs(a - b) <= tolerance for a, b in zip(first_was, first_now))
        if not (close(sum_was, sum_now) and close(norm_was, norm_now) and values_close):
            found.append(f"weights {name}: sum {sum_now} norm {norm_now} (before: {sum_was}, {norm_was})")
    return found


def prove(names: list[str] | None = None) -> dict[str, dict]:
    """Each named job's figures (every job without names), run in a temporary folder."""
    jobs = [job for job in JOBS if not names or job.name in names]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        inputs = make_inputs(root, {job.data for job in jobs})
        return {job.name: run_job(job, inputs, root) for job in jobs}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    figures = prove(sys.argv[2:] or None)
    out.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    print(f"{len(figures)} jobs -> {out}")
