"""Embeddings on one GPU: `inference.embedding.packed_encode` against
`SentenceTransformer.encode` on the same CUDA device, same model object, same texts.

    python bench/bench_gpu_inference.py --model FOLDER --texts DIR [--rounds 3] [--out DIR]
    python bench/bench_gpu_inference.py --write-texts DIR      # here: the three profiles' texts
    python bench/bench_gpu_inference.py --random-weights FOLDER # there: fill a skeleton folder

The texts are bench_embed.py's three length profiles (BBC News: `sentences`, `mixed`,
`paragraphs`), written once to DIR/<profile>.jsonl on a machine with the corpus, so the GPU
machine (no corpus there) reads the same texts. `--random-weights` writes a seeded
model.safetensors for a folder that travels without its weights (MiniLM's 90 MB do not fit a
transfer): speed depends on the shapes, not the values, and agreement is measured on the same
weights on both sides.

Per profile and dtype (float32; bfloat16: both sides' weights cast to bf16), rounds
interleave the two sides (rotated); each call is bracketed by torch.cuda.synchronize. Reported:
texts/s, the ratio packed/encode, and the lowest cosine between the two sides' vectors.
Writes OUT/gpu_inference.json and prints one markdown table.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PROFILES = ("sentences", "mixed", "paragraphs")


def write_texts(out: Path, count: int = 4000) -> None:
    """bench_embed.py's profiles, the same picks (seeds 0 and 1), one JSONL per profile."""
    from packed_transformers.data.assets import corpus_glob
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of

    articles = bbc_articles(corpus_glob())
    out.mkdir(parents=True, exist_ok=True)
    for profile in PROFILES:
        if profile == "paragraphs":
            paragraphs = texts_of(articles, "paragraphs")
            starts = np.random.default_rng(1).choice(
                len(paragraphs) - 4, size=len(paragraphs) // 5, replace=False
            )
            texts = paragraphs + [" ".join(paragraphs[j : j + 4]) for j in starts]
        else:
            texts = texts_of(articles, profile)
        picks = np.random.default_rng(0).choice(len(texts), size=min(count, len(texts)), replace=False)
        lines = "".join(json.dumps({"text": texts[i]}) + "\n" for i in picks)
        (out / f"{profile}.jsonl").write_text(lines)
        print(f"{out / profile}.jsonl: {len(picks)} texts")


def random_weights(folder: Path) -> None:
    """A seeded BertModel of the folder's config.json, saved as its model.safetensors."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig.from_pretrained(folder)
    BertModel(config).save_pretrained(folder, safe_serialization=True)


def timed(call, device: str) -> tuple[float, np.ndarray]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    vectors = call()
    sync()
    return time.perf_counter() - started, np.asarray(vectors, dtype=np.float32)


def measure(model_folder: Path, texts: list[str], dtype: str, rounds: int, device: str = "cuda") -> dict:
    from sentence_transformers import SentenceTransformer

    from packed_transformers.inference.embedding import packed_encode

    st = SentenceTransformer(str(model_folder), device=device)
    if dtype == "bfloat16":
        st = st.to(torch.bfloat16)
    ours = copy.deepcopy(st)  # its own object: packed_encode keeps its encoder on the model
    sides = {
        "encode": lambda: st.encode(texts, batch_size=32, convert_to_numpy=True),
        "packed": lambda: packed_encode(ours, texts, dtype=dtype),
    }
    for call in sides.values():  # warm-up: CUDA context, kernels, the packed encoder
        call()
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    vectors = {}
    names = list(sides)
    for r in range(rounds):
        for name in names[r % 2 :] + names[: r % 2]:
            took, vectors[name] = timed(sides[name], device)
            seconds[name].append(took)
    a, b = vectors["encode"], vectors["packed"]
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    median = {name: statistics.median(s) for name, s in seconds.items()}
    return {
        "texts": len(texts),
        "encode_texts_per_second": len(texts) / median["encode"],
        "packed_texts_per_second": len(texts) / median["packed"],
        "packed_over_encode": median["encode"] / median["packed"],
        "lowest_cosine": float(cosine.min()),
        "seconds": seconds,
    }


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a sentence-transformers folder (BERT-family)")
    parser.add_argument("--texts", type=Path, help="the folder --write-texts wrote")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=PROFILES)
    parser.add_argument("--out", type=Path, default=Path("bench_out/gpu"))
    parser.add_argument("--write-texts", type=Path, metavar="DIR")
    parser.add_argument("--random-weights", type=Path, metavar="FOLDER")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a rehearsal")
    parser.add_argument("--limit", type=int, help="the first N texts of each profile (a rehearsal)")
    args = parser.parse_args()
    if args.write_texts:
        write_texts(args.write_texts)
        return 0
    if args.random_weights:
        random_weights(args.random_weights)
        return 0
    if args.model is None or args.texts is None:
        parser.error("--model and --texts are needed for a measurement")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"error: bench_gpu_inference.py needs a CUDA GPU; torch {torch.__version__} sees none",
            file=sys.stderr,
        )
        return 2
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    print(f"# {device}, torch {torch.__version__}, commit {commit()}")
    print("| profile | dtype | texts | encode texts/s | packed texts/s | packed/encode | lowest cosine |")
    print("|---|---|---|---|---|---|---|")
    for profile in args.profiles:
        texts = [json.loads(line)["text"] for line in (args.texts / f"{profile}.jsonl").open()][: args.limit]
        for dtype in args.dtypes:
            result = measure(args.model, texts, dtype, args.rounds, args.device)
            runs.append(
                {
                    "date": datetime.date.today().isoformat(),
                    "commit": commit(),
                    "device": device,
                    "torch": torch.__version__,
                    "profile": profile,
                    "dtype": dtype,
                    **result,
                }
            )
            print(
                f"| {profile} | {dtype} | {result['texts']} | {result['encode_texts_per_second']:.0f} | "
                f"{result['packed_texts_per_second']:.0f} | {result['packed_over_encode']:.2f} | "
                f"{result['lowest_cosine']:.6f} |",
                flush=True,
            )
            (args.out / "gpu_inference.json").write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
