"""What packing can save over length grouping, by arithmetic: the ceiling of "packed / Trainer's
group_by_length" for a fine-tuning step whose time follows its FLOPs.

    python bench/bench_padding_ceiling.py [--batch 32] [--seed 42] [--json out.json]

For each length profile of BBC News (tokenized by the MiniLM folder's own tokenizer, cut at the
profile's maximum length), three ways to form the batches of one epoch:

  grouped   transformers' own `get_length_grouped_indices` (what Trainer's group_by_length
            samples: a random order cut into megabatches of 50 x batch, each sorted by length),
            batches of --batch examples, each padded to its longest
  packed    this project's packs (lp, K chosen from the lengths as batching.max_sequences_per_pack
            null chooses it) at pack_length = the profile's maximum length (the default)
  packed 2x packs twice that long (positions restart in every sequence, so a pack may be longer
            than the model's positions)

and counts, per epoch, the token slots (real + padding) and the attention scores; the FLOPs of
an encoder step are then slots x 2(4H^2 + 2HI) + scores x 4H per layer (the projections and
feed-forward per token; QK^T and PV per score; H, I from the folder's config.json; embeddings and
head left out, the same for every way). Packed attention is counted as the varlen backend does
it: the sum of l_i^2 per sequence. The ratio grouped / packed of those FLOPs is the most a packed
step can gain from removing padding where step time follows FLOPs; a measured ratio above it
comes from elsewhere in the step (on long texts in training, transformers' attention dropout
on a CPU: docs/finetune.md). Nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True)
class Batching:
    """One way to form an epoch's batches: token slots (real + padding) and attention scores."""

    slots: int
    scores: int
    real: int

    @property
    def padding(self) -> float:
        return 1 - self.real / self.slots


@dataclass(frozen=True)
class EncoderShape:
    """FLOPs per layer of an encoder: per token slot and per attention score."""

    hidden: int
    intermediate: int

    def flops(self, batching: Batching) -> float:
        per_slot = 2 * (4 * self.hidden**2 + 2 * self.hidden * self.intermediate)
        return batching.slots * per_slot + batching.scores * 4 * self.hidden


def grouped(lengths: np.ndarray, batch: int, seed: int) -> Batching:
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    generator = torch.Generator()
    generator.manual_seed(seed)
    order = np.asarray(get_length_grouped_indices(lengths.tolist(), batch, generator=generator))
    widths = [int(lengths[order[i : i + batch]].max()) for i in range(0, len(order), batch)]
    sizes = [len(order[i : i + batch]) for i in range(0, len(order), batch)]
    return Batching(
        slots=sum(n * w for n, w in zip(sizes, widths)),
        scores=sum(n * w * w for n, w in zip(sizes, widths)),
        real=int(lengths.sum()),
    )


def packed(lengths: np.ndarray, pack_length: int, seed: int) -> tuple[Batching, int]:
    from packed_transformers.packs.tokenized import pack_examples

    table = pack_examples(lengths, pack_length, None, "lp", seed)
    batching = Batching(
        slots=len(table) * pack_length, scores=int((lengths**2).sum()), real=int(lengths.sum())
    )
    return batching, table.shape[1]


def profiles(tokenizer) -> dict[str, Callable[[], tuple[np.ndarray, int]]]:
    """name -> a call giving (token counts, maximum length) of each BBC News length profile
    (tokenized when called: --profiles N tokenizes the first N only)."""
    from packed_transformers.data.assets import corpus_glob
    from packed_transformers.data.classification_data import read_bbc_news
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of

    def counts(texts, cap, pairs=None):
        encoded = tokenizer.encode_batch(list(zip(texts, pairs)) if pairs else texts)
        return np.array([min(len(e.ids), cap) for e in encoded], dtype=np.int64)

    articles = bbc_articles(corpus_glob())
    sentences, mixed = texts_of(articles, "sentences"), texts_of(articles, "mixed")
    rng = np.random.default_rng(0)  # the sentences' draw, then the mixed texts' (the figures' draws)
    picked = {
        "sentences": rng.choice(len(sentences), 4000, False),
        "mixed": rng.choice(len(mixed), 4000, False),
    }

    def drawn(kind: str) -> list[str]:
        texts = sentences if kind == "sentences" else mixed
        return [texts[i] for i in picked[kind]]

    def titles_and_first_sentences():
        topics = read_bbc_news(corpus_glob())
        return counts(topics.texts, 128, topics.pairs), 128

    return {
        "title + first sentence (configs/finetune_bbc.yaml)": titles_and_first_sentences,
        "sentences (4,000)": lambda: (counts(drawn("sentences"), 128), 128),
        "paragraphs": lambda: (counts(texts_of(articles, "paragraphs"), 512), 512),
        "mixed (4,000 titles, sentences, paragraphs)": lambda: (counts(drawn("mixed"), 512), 512),
        "articles, cut at 512": lambda: (counts(texts_of(articles, "articles"), 512), 512),
        "articles, cut at 256": lambda: (counts(texts_of(articles, "articles"), 256), 256),
    }


def main() -> int:
    from tokenizers import Tokenizer

    from bench.machine import description
    from packed_transformers.data.assets import model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32, help="examples per grouped batch (Trainer's)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--profiles", type=int, default=None, help="the first N profiles only (all by default)"
    )
    args = parser.parse_args()
    folder = model_dir()
    config = json.loads((folder / "config.json").read_text())
    shape = EncoderShape(config["hidden_size"], config["intermediate_size"])
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    print(f"# {description()}")
    print(f"# grouped: batches of {args.batch}; FLOPs per layer of H={shape.hidden}, I={shape.intermediate}")
    print("| profile | examples, mean / max tokens | grouped padding | packed padding (K) | packed 2x padding (K) "
          "| ceiling packed / grouped | ceiling packed 2x / grouped |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name, measure in list(profiles(tokenizer).items())[: args.profiles]:
        lengths, longest = measure()
        group = grouped(lengths, args.batch, args.seed)
        pack, depth = packed(lengths, longest, args.seed)
        pack2, depth2 = packed(lengths, 2 * longest, args.seed)
        ceiling, ceiling2 = shape.flops(group) / shape.flops(pack), shape.flops(group) / shape.flops(pack2)
        print(f"| {name} | {len(lengths):,}, {lengths.mean():.0f} / {lengths.max()} | {group.padding:.1%} | "
              f"{pack.padding:.1%} ({depth}) | {pack2.padding:.1%} ({depth2}) | {ceiling:.3f}x | {ceiling2:.3f}x |")  # fmt: skip
        rows.append({"profile": name, "examples": len(lengths), "max_length": longest,
                     "grouped": asdict(group), "packed": asdict(pack), "packed_2x": asdict(pack2),
                     "K": depth, "K_2x": depth2, "ceiling": ceiling, "ceiling_2x": ceiling2})  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps({"machine": description(), "batch": args.batch, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
