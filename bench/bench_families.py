"""Packed inference, fine-tuning and embeddings per encoder family against what users of
transformers and sentence-transformers run instead, on base-sized shapes (random weights:
speed does not depend on them).

    python bench/bench_families.py [--families roberta deberta-v2 modernbert mpnet]
        [--texts 400] [--train-texts 640] [--rounds 2] [--threads 2]
        [--compare sorted pipeline trainer embed]

For each family a 12-layer, 768-wide sequence classifier is built from its config class
with BERT's vocabulary size and saved as transformers saves it. The same BBC News texts
(titles, sentences, paragraphs; data/embedding_texts.py), tokenized once with the MiniLM
folder's WordPiece (ids only matter for speed through their count), run two ways, rounds
alternating which goes first:

  sorted   transformers: AutoModelForSequenceClassification, texts sorted by length,
           batches of 32 padded to their longest (attention mask, SDPA): what a user who
           sorts writes, and faster than `pipeline`'s unsorted batches
  packed   this project: model/families.py through inference.runner in width groups
           (commands.predict's path for a folder without a pack length)

  pipeline transformers' `pipeline("text-classification", batch_size=32)` on the texts,
           against packed with its tokenization timed too
  trainer  fine-tuning one epoch of `--train-texts` texts (cut at 128 tokens, random labels):
           transformers' Trainer, train_sampling_strategy="group_by_length" and
           DataCollatorWithPadding, batch 16, against the same Trainer over
           hf_integration.trainer.pack_dataset's packs (128 tokens, up to 6 texts) with
           PackedFamilyModel: the same examples per step (16 / packing factor packs).
           Give Trainer enough texts to group: its sampler sorts by length within
           megabatches of min(50, texts // 64) x 16 texts, so 96 texts make megabatches
           of one batch (no grouping at all) and 640 make them of 160 texts

Decoders (--families llama qwen3 gpt2 ...): the same comparisons on a 12-layer, 768-wide
decoder (4 key/value heads where the family has them); sorted pads on the right, as
transformers' decoder classifiers read the last non-pad token; embed pools the last token.

  embed    a sentence-transformers model (the encoder + mean pooling; decoders: last token):
           `SentenceTransformer.encode(batch_size=32)` against `packed_encode`

Printed per comparison: texts/s per way (median over rounds) and packed / theirs, paired
per round; the outputs of both are compared (max |logit difference| or min cosine).
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


# Decoders at base size: 12 layers, 768 wide, grouped-query attention (4 key/value heads)
# where the family has it; the embed comparison pools the last token, as decoder embedders do.
DECODERS = {
    "llama": {"num_key_value_heads": 4},
    "mistral": {"num_key_value_heads": 4},
    "qwen2": {"num_key_value_heads": 4},
    "qwen3": {"num_key_value_heads": 4, "head_dim": 64},
    "phi3": {"num_key_value_heads": 4},
    "gemma3_text": {"num_key_value_heads": 4, "head_dim": 64, "query_pre_attn_scalar": 64},
}


def base_config(model_type: str, layers: int = 12):
    """The family's base-sized random config (12 layers; `layers` fewer for a smoke)."""
    from transformers import AutoConfig

    if model_type == "gpt2":
        return AutoConfig.for_model("gpt2", n_embd=768, n_layer=layers, n_head=12, vocab_size=30522, num_labels=5,
                                    pad_token_id=0, n_positions=1024)  # fmt: skip
    if model_type in DECODERS:
        return AutoConfig.for_model(model_type, **{**BASE, "num_hidden_layers": layers}, vocab_size=30522,
                                    num_labels=5, pad_token_id=0, max_position_embeddings=1024, tie_word_embeddings=False,
                                    **DECODERS[model_type])  # fmt: skip
    size = {**BASE, "num_hidden_layers": layers}
    if model_type == "distilbert":
        size = {"dim": 768, "n_layers": min(6, layers), "n_heads": 12, "hidden_dim": 3072}
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


def timed(call) -> tuple[float, object]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def trainer_epoch(model, dataset, collator, batch_size: int, grouped: bool) -> float:
    """Seconds of Trainer's training loop over one epoch of `dataset` (AdamW, lr 2e-5)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class LoopClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            self.seconds = time.perf_counter() - self.started

    clock = LoopClock()
    counted = {"row_tokens": 0, "steps": 0}

    def counting(features):  # what each step costs: the rows' tokens, padding included
        batch = collator(features)
        counted["row_tokens"] += int(batch["input_ids"].numel())
        counted["steps"] += 1
        return batch

    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(
            output_dir=folder, per_device_train_batch_size=batch_size, learning_rate=2e-5, num_train_epochs=1,
            train_sampling_strategy="group_by_length" if grouped else "random", logging_strategy="no",
            save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True, seed=0,
        )  # fmt: skip
        Trainer(
            model=model, args=args, train_dataset=dataset, data_collator=counting, callbacks=[clock]
        ).train()
    print(
        f"  trainer: {counted['steps']} steps, {counted['row_tokens']:,} row tokens, {clock.seconds:.1f} s",
        flush=True,
    )
    return clock.seconds


class Ways:
    """For one family: the two ways of each comparison, as calls -> (seconds, outputs)."""

    def __init__(self, family: str, folder: str, texts: list[str], train_texts: list[str], tokenizer):
        import torch
        import transformers
        from datasets import Dataset

        from packed_transformers.data.classification_data import TokenizedExamples
        from packed_transformers.inference.runner import Runner
        from packed_transformers.model.family_model import PackedFamilyModel

        self.folder, self.texts, self.tokenizer = folder, texts, tokenizer
        auto = transformers.AutoModelForSequenceClassification
        try:  # SDPA where the family has it (DeBERTa-v2 and MPNet have their own attention)
            self.reference = auto.from_pretrained(folder, attn_implementation="sdpa").eval()
            self.sdpa = True
        except ValueError:
            self.reference = auto.from_pretrained(folder).eval()
            self.sdpa = False
        self.ours = Runner(PackedFamilyModel.from_pretrained(folder, "classification"))
        encoded = tokenizer(texts, truncation=True, max_length=256)["input_ids"]
        self.token_ids = [np.asarray(t, dtype=np.int64) for t in encoded]
        self.data = TokenizedExamples(
            self.token_ids, [np.zeros_like(t) for t in self.token_ids], np.zeros(len(texts)), 0
        )
        labels = np.random.default_rng(0).integers(0, 5, len(train_texts)).tolist()
        train_ids = tokenizer(train_texts, truncation=True, max_length=128)["input_ids"]
        self.train = Dataset.from_dict({"input_ids": train_ids, "labels": labels})
        torch.manual_seed(0)

    # inference ---------------------------------------------------------------------------
    def packed(self, with_tokenizing: bool = False):
        from packed_transformers.inference.classify import InferenceOptions, predict_in_width_groups

        options = InferenceOptions(
            batching="packed", batch_size=64, max_sequences_per_pack=6, algorithm="lpfhp"
        )

        def call():
            data = self.data
            if with_tokenizing:
                from packed_transformers.data.classification_data import TokenizedExamples

                ids = self.tokenizer(self.texts, truncation=True, max_length=256)["input_ids"]
                ids = [np.asarray(t, dtype=np.int64) for t in ids]
                data = TokenizedExamples(ids, [np.zeros_like(t) for t in ids], np.zeros(len(ids)), 0)
            return predict_in_width_groups(options, self.ours, data, 256)[0]

        return timed(call)

    def packed_tokenizing(self):
        return self.packed(with_tokenizing=True)

    def sorted(self):
        return timed(lambda: sorted_loop(self.reference, self.token_ids))

    def pipeline(self):
        from transformers import pipeline

        classify = pipeline(
            "text-classification", model=self.reference, tokenizer=self.tokenizer, device="cpu"
        )
        seconds, results = timed(
            lambda: classify(self.texts, batch_size=32, truncation=True, max_length=256, top_k=None)
        )
        order = [self.reference.config.id2label[i] for i in range(self.reference.config.num_labels)]
        scores = np.array(
            [[{r["label"]: r["score"] for r in row}[name] for name in order] for row in results]
        )
        return seconds, np.log(scores)  # log-softmax: compared with the packed logits' log-softmax

    # fine-tuning -------------------------------------------------------------------------
    def trainer_grouped(self):
        import transformers
        from transformers import DataCollatorWithPadding

        auto = transformers.AutoModelForSequenceClassification
        model = auto.from_pretrained(self.folder, **({"attn_implementation": "sdpa"} if self.sdpa else {}))
        collator = DataCollatorWithPadding(self.tokenizer)
        return trainer_epoch(model, self.train, collator, 16, grouped=True), None

    def trainer_packed(self):
        from packed_transformers.hf_integration.trainer import PackedDataCollator, pack_dataset
        from packed_transformers.model.family_model import PackedFamilyModel

        def call():
            packs = pack_dataset(
                self.train, "single_label_classification", 128, 6, num_labels=5, verbose=False
            )
            batch = max(1, round(16 * len(packs) / len(self.train)))  # the same examples per step
            model = PackedFamilyModel.from_pretrained(self.folder, "classification")
            return trainer_epoch(model, packs, PackedDataCollator(), batch, grouped=False)

        return call(), None

    # embeddings --------------------------------------------------------------------------
    def sentence_transformer(self):
        from sentence_transformers import SentenceTransformer, models

        if not hasattr(self, "_st"):
            transformer = models.Transformer(self.folder, max_seq_length=256)
            decoder = (
                self.reference.config.model_type in DECODERS or self.reference.config.model_type == "gpt2"
            )
            pooling = models.Pooling(
                transformer.get_embedding_dimension(), "lasttoken" if decoder else "mean"
            )
            self._st = SentenceTransformer(modules=[transformer, pooling], device="cpu")
            self._packed_st = SentenceTransformer(modules=[transformer, pooling], device="cpu")
        return self._st

    def encode(self):
        model = self.sentence_transformer()
        return timed(lambda: model.encode(self.texts, batch_size=32, convert_to_numpy=True))

    def packed_encode(self):
        from packed_transformers.inference.embedding import packed_encode

        self.sentence_transformer()
        return timed(lambda: packed_encode(self._packed_st, self.texts))


COMPARISONS = {  # name -> (their way, our way, how outputs compare, unit of the table)
    "sorted": ("sorted", "packed", "logits"),
    "pipeline": ("pipeline", "packed_tokenizing", "log-probabilities"),
    "trainer": ("trainer_grouped", "trainer_packed", None),
    "embed": ("encode", "packed_encode", "cosine"),
}
TITLES = {
    "sorted": "inference: transformers' length-sorted loop (batch 32, padded to the longest)",
    "pipeline": "inference: transformers' pipeline (batch 32), tokenization timed in both",
    "trainer": "fine-tuning: Trainer + group_by_length (batch 16) vs the same Trainer on packs",
    "embed": "embeddings: SentenceTransformer.encode (batch 32) vs packed_encode",
}


def difference(kind: str | None, theirs, ours) -> str:
    if kind is None:
        return "-"
    if kind == "cosine":
        a = theirs / np.linalg.norm(theirs, axis=1, keepdims=True)
        b = ours / np.linalg.norm(ours, axis=1, keepdims=True)
        return f"min cosine {float((a * b).sum(1).min()):.6f}"
    if kind == "log-probabilities":
        ours = ours - np.log(np.exp(ours).sum(1, keepdims=True))
    return f"max |difference| {float(np.abs(theirs - ours).max()):.1e}"


def main() -> int:
    import torch
    import transformers

    from packed_transformers.data.assets import corpus_glob, model_dir
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["roberta", "deberta-v2", "modernbert", "mpnet"])
    parser.add_argument("--texts", type=int, default=400)
    parser.add_argument("--train-texts", type=int, default=640)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compare", nargs="+", choices=list(COMPARISONS), default=list(COMPARISONS))
    parser.add_argument("--layers", type=int, default=12, help="layers of every random model (base: 12)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir())
    encoder_inputs = list(tokenizer.model_input_names)
    texts = texts_of(bbc_articles(corpus_glob()), "mixed")
    picks = np.random.default_rng(0).choice(len(texts), size=args.texts + args.train_texts, replace=False)
    chosen = [texts[i] for i in picks[: args.texts]]
    train_texts = [texts[i] for i in picks[args.texts :]]
    lengths = [len(t) for t in tokenizer(chosen, truncation=True, max_length=256)["input_ids"]]
    print(f"# {len(chosen)} BBC texts ({sum(lengths)} tokens, median {int(np.median(lengths))}); "
          f"{len(train_texts)} training texts; base-width random classifiers of {args.layers} layers; {args.threads} threads, "
          f"float32, {args.rounds} rounds", flush=True)  # fmt: skip
    tables = {name: [] for name in args.compare}
    for family in args.families:
        with tempfile.TemporaryDirectory() as scratch:
            torch.manual_seed(0)
            transformers.AutoModelForSequenceClassification.from_config(
                base_config(family, args.layers)
            ).save_pretrained(scratch)
            # a decoder's tokenizer hands no token_type_ids (GPT-2 would add wte(0) to every
            # token if one did, which its own tokenizer never asks for)
            decoder = family in DECODERS or family == "gpt2"
            tokenizer.model_input_names = ["input_ids", "attention_mask"] if decoder else encoder_inputs
            tokenizer.save_pretrained(scratch)
            ways = Ways(family, scratch, chosen, train_texts, tokenizer)
            for name in args.compare:
                theirs_name, ours_name, kind = COMPARISONS[name]
                seconds = {theirs_name: [], ours_name: []}
                ratios, shown = [], "-"
                count = len(train_texts) if name == "trainer" else len(chosen)
                for r in range(args.rounds):
                    order = (theirs_name, ours_name) if r % 2 == 0 else (ours_name, theirs_name)
                    results = {}
                    for way in order:
                        took, results[way] = getattr(ways, way)()
                        seconds[way].append(took)
                    ratios.append(seconds[theirs_name][-1] / seconds[ours_name][-1])
                    shown = difference(kind, results[theirs_name], results[ours_name])
                row = (f"| {family} | {count / statistics.median(seconds[theirs_name]):.1f} | "
                       f"{count / statistics.median(seconds[ours_name]):.1f} | **{statistics.median(ratios):.2f}x** "
                       f"({min(ratios):.2f}-{max(ratios):.2f}) | {shown} |")  # fmt: skip
                tables[name].append(row)
                print(f"{name}: {row}", flush=True)
    for name, rows in tables.items():
        print(f"\n## {TITLES[name]}\n")
        print("| family | theirs, texts/s | packed, texts/s | packed / theirs, paired (range) | outputs |")
        print("|---|---|---|---|---|")
        print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
