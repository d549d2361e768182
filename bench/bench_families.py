"""Packed inference per encoder family against transformers' own length-sorted loop, on
base-sized shapes (random weights: speed does not depend on them).

    python bench/bench_families.py [--families roberta deberta-v2 modernbert mpnet]
        [--texts 400] [--rounds 2] [--threads 2]

For each family a 12-layer, 768-wide sequence classifier is built from its config class
with BERT's vocabulary size and saved as transformers saves it. The same BBC News texts
(titles, sentences, paragraphs; data/embedding_texts.py), tokenized once with the MiniLM
folder's WordPiece (ids only matter for speed through their count), run two ways, rounds
alternating which goes first:

  sorted   transformers: AutoModelForSequenceClassification, texts sorted by length,
           batches of 32 padded to their longest (attention mask, SDPA): what a user who
           sorts writes, and faster than `pipeline`'s unsorted batches
  packed   this project: model/families.py through finetune.runner in width groups
           (finetune.predict's path for a folder without a pack length)

Printed: texts/s per way (median over rounds) and packed / sorted, paired per round; the
logits of both are compared (max |difference|).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}


def base_config(model_type: str):
    from transformers import AutoConfig

    size = dict(BASE)
    if model_type == "distilbert":
        size = {"dim": 768, "n_layers": 6, "n_heads": 12, "hidden_dim": 3072}
    extra = {"vocab_size": 30522, "num_labels": 5, "pad_token_id": 0, "max_position_embeddings": 514}
    if model_type == "modernbert":
        extra.update(global_attn_every_n_layers=3, local_attention=128, cls_token_id=101, sep_token_id=102,
                     bos_token_id=101, eos_token_id=102)  # fmt: skip
    if model_type == "deberta-v2":
        extra.update(relative_attention=True, position_buckets=256, max_relative_positions=512,
                     pos_att_type=["p2c", "c2p"], position_biased_input=False, type_vocab_size=0)  # fmt: skip
    return AutoConfig.for_model(model_type, **size, **extra)


def sorted_loop(model, token_ids: list, batch: int = 32) -> np.ndarray:
    import torch

    order = np.argsort([len(t) for t in token_ids], kind="stable")
    out = np.empty((len(token_ids), model.config.num_labels), dtype=np.float32)
    with torch.inference_mode():
        for first in range(0, len(order), batch):
            chosen = order[first : first + batch]
            width = max(len(token_ids[i]) for i in chosen)
            ids = torch.zeros((len(chosen), width), dtype=torch.long)
            mask = torch.zeros((len(chosen), width), dtype=torch.long)
            for row, i in enumerate(chosen):
                ids[row, : len(token_ids[i])] = torch.from_numpy(token_ids[i])
                mask[row, : len(token_ids[i])] = 1
            out[chosen] = model(input_ids=ids, attention_mask=mask).logits.float().numpy()
    return out


def main() -> int:
    import torch
    import transformers

    from data.assets import corpus_glob, model_dir
    from data.classification_data import TokenizedExamples
    from data.embedding_texts import bbc_articles, texts_of
    from finetune.predict import predict_in_width_groups
    from finetune.runner import Runner
    from model.families import PackedFamilyModel

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["roberta", "deberta-v2", "modernbert", "mpnet"])
    parser.add_argument("--texts", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir())
    texts = texts_of(bbc_articles(corpus_glob()), "mixed")
    picks = np.random.default_rng(0).choice(len(texts), size=args.texts, replace=False)
    encoded = tokenizer([texts[i] for i in picks], truncation=True, max_length=256)["input_ids"]
    token_ids = [np.asarray(t, dtype=np.int64) for t in encoded]
    data = TokenizedExamples(token_ids, [np.zeros_like(t) for t in token_ids], np.zeros(len(token_ids)), 0)
    options = argparse.Namespace(batching="packed", batch_size=64, max_sequences_per_pack=6, algorithm="lpfhp",
                                 pack_length=None)  # fmt: skip
    print(f"# {len(token_ids)} BBC texts ({int(data.lengths.sum())} tokens, median {int(np.median(data.lengths))}), "
          f"base-sized random classifiers, {args.threads} threads, float32, {args.rounds} rounds")  # fmt: skip
    print(
        "| family | sorted transformers, texts/s | packed, texts/s | packed / sorted (paired) | max |logit difference| |"
    )
    print("|---|---|---|---|---|")
    for family in args.families:
        with tempfile.TemporaryDirectory() as scratch:
            torch.manual_seed(0)
            transformers.AutoModelForSequenceClassification.from_config(base_config(family)).save_pretrained(
                scratch
            )
            auto = transformers.AutoModelForSequenceClassification
            try:  # SDPA where the family has it (DeBERTa-v2 and MPNet have their own attention)
                reference = auto.from_pretrained(scratch, attn_implementation="sdpa").eval()
            except ValueError:
                reference = auto.from_pretrained(scratch).eval()
            ours = Runner(PackedFamilyModel.from_pretrained(scratch, "classification"))
        rates = {"sorted": [], "packed": []}
        ratios, difference = [], 0.0
        for r in range(args.rounds):
            seconds = {}
            for way in ("sorted", "packed") if r % 2 == 0 else ("packed", "sorted"):
                started = time.perf_counter()
                if way == "sorted":
                    expected = sorted_loop(reference, token_ids)
                else:
                    got, _ = predict_in_width_groups(options, ours, data, 256)
                seconds[way] = time.perf_counter() - started
                rates[way].append(len(token_ids) / seconds[way])
            ratios.append(seconds["sorted"] / seconds["packed"])
            difference = max(difference, float(np.abs(got - expected).max()))
        print(f"| {family} | {statistics.median(rates['sorted']):.1f} | {statistics.median(rates['packed']):.1f} | "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | {difference:.1e} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
