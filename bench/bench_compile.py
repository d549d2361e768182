"""torch.compile of the packed encoder at the pack widths, against eager (issue 60).

    python bench/bench_compile.py [--texts 2000] [--passes 3] [--threads 2] [--input TEXTS.jsonl]

The MiniLM folder opened as commands.embed opens it (inference.embedding.load_encoder), then
`inference.embedding.encode` over the same texts `--passes` times in each of two fresh
processes: eager, and compiled as `embed --compile` compiles (InferenceOptions.compile:
inference.torch_backend.compiled_forward, inductor with `freezing`, weights folded and pre-packed
for oneDNN; static shapes, one graph per row width, each width's tables padded to its
rows). The first compiled pass pays the compiling. Vectors compared.
Default texts: BBC News, the mixed profile (data/embedding_texts.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORKER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
torch.set_num_threads(int(sys.argv[4]))
from packed_transformers.data.assets import model_dir
from packed_transformers.inference.embedding import encode, load_encoder
from packed_transformers.inference.options import InferenceOptions
texts = [json.loads(line)["text"] for line in open(sys.argv[2])]
encoder = load_encoder(model_dir())
options = InferenceOptions.for_embedding(compile=sys.argv[3] == "compiled")  # `embed --compile`
seconds = []
for _ in range(int(sys.argv[5])):
    started = time.perf_counter()
    vectors = encode(texts, encoder, options)
    seconds.append(time.perf_counter() - started)
np.save(sys.argv[6], vectors)
print(json.dumps(seconds))
"""


def main() -> int:
    import numpy as np

    from packed_transformers.data.assets import corpus_glob
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--input", type=Path, help="JSON lines with a 'text' field (default: BBC mixed)")
    args = parser.parse_args()
    if args.input:
        texts = [json.loads(line)["text"] for line in args.input.open()][: args.texts]
    else:
        texts = texts_of(bbc_articles(corpus_glob()), "mixed")[: args.texts]
    seconds, vectors = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "texts.jsonl"
        source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        for way in ("eager", "compiled"):
            out = Path(scratch) / f"{way}.npy"
            done = subprocess.run(
                [sys.executable, "-c", WORKER, str(REPO), str(source), way, str(args.threads), str(args.passes),
                 str(out)], capture_output=True, text=True, check=False,
            )  # fmt: skip
            if done.returncode:
                raise RuntimeError(f"{way} failed: {done.stderr[-2000:]}")
            seconds[way] = json.loads(done.stdout.strip().splitlines()[-1])
            vectors[way] = np.load(out)
    difference = float(np.abs(vectors["eager"] - vectors["compiled"]).max())
    cosine = float((vectors["eager"] * vectors["compiled"]).sum(1).min())
    print(f"# {len(texts)} texts, {args.threads} threads, fp32; seconds per pass")
    print("| way | " + " | ".join(f"pass {i}" for i in range(args.passes)) + " |")
    print("|---|" + "---|" * args.passes)
    for way, values in seconds.items():
        print(f"| {way} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    steady = min(seconds["eager"][1:] or seconds["eager"]) / min(
        seconds["compiled"][1:] or seconds["compiled"]
    )
    compiling = seconds["compiled"][0] - min(seconds["compiled"][1:] or seconds["compiled"])
    print(f"\nsteady state compiled / eager: {steady:.2f}x; compiling took about {compiling:.0f} s; "
          f"max difference {difference:.1e}, min cosine {cosine:.7f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
