"""Data generation speed: ours against google-research/bert's reference generator
(bert-tensorflow 1.0.4, run as tests/reference_bert.py runs it), on the same text and seed,
checking the output is identical.

    python bench/bench_create_data.py [--documents 2225] [--dupe-factor 2]

The text: BBC News articles (the demo corpus) in the reference's format, a sentence per line.
Both sides are timed from text files to instances in memory (our time includes writing the
HDF5 shard; the reference's excludes writing TFRecords). One process each, this machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from packed_transformers.data import assets  # noqa: E402
from packed_transformers.data.create_pretraining_data import main as create_main  # noqa: E402
from packed_transformers.data.create_pretraining_data import read_document, split_sentences  # noqa: E402
from tests import reference_bert  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--documents", type=int, default=2225)
    parser.add_argument("--dupe-factor", type=int, default=2)
    parser.add_argument("--max-seq-length", type=int, default=512)
    args = parser.parse_args()
    files = assets.corpus_files()[: args.documents]
    vocab = assets.vocab_file()
    s, p = args.max_seq_length, max(1, round(args.max_seq_length * 0.15))
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "part-00000-of-00001"
        text.write_text("\n\n".join("\n".join(split_sentences(read_document(f)[0])) for f in files) + "\n")
        t0 = time.perf_counter()
        reference = reference_bert.reference_arrays([text], vocab, 12345, s, p, args.dupe_factor)
        reference_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        argv = ["--input", str(text), "--vocab", str(vocab), "--output", f"{tmp}/out", "--quiet"]
        argv += [
            "--max-seq-length",
            str(s),
            "--max-predictions-per-seq",
            str(p),
            "--dupe-factor",
            str(args.dupe_factor),
        ]
        assert create_main(argv) == 0
        ours_s = time.perf_counter() - t0
        with h5py.File(f"{tmp}/out/part-00000.h5") as f:
            same = all(np.array_equal(f[name][:].astype(np.int64), reference[name]) for name in reference)
    n = len(reference["input_ids"])
    print(
        f"\n{len(files)} documents, dupe factor {args.dupe_factor}, S={s}, P={p}: {n:,} sequences, identical: {same}\n"
    )
    print("| generator | seconds | sequences/s |")
    print("|---|---|---|")
    print(f"| reference (google-research/bert) | {reference_s:.1f} | {n / reference_s:,.0f} |")
    print(f"| ours | {ours_s:.1f} | {n / ours_s:,.0f} |")
    print(f"\nours/reference: {reference_s / ours_s:.2f}x")


if __name__ == "__main__":
    main()
