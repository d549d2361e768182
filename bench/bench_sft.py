"""Supervised fine-tuning of a decoder, packed, against TRL's SFTTrainer on the same data and
device (issue 58), and what TRL's own packing would let leak across sequences here.

    python bench/bench_sft.py [--parts packing leak sft peers] [--examples 400] [--steps 4] [--threads 2]
        [--shape base|small] [--rows-per-step 1 2 4] [--spread]

Data: BBC News as prompt/completion pairs ("Write a headline for this article:" + the
article's body, cut at --body-chars characters; the headline as completion), tokenized by
a byte-level BPE learned from the same corpus (BOS, EOS, pad). Model: a base-sized random
Llama (12 layers, 768 wide, 4 key/value heads; speed does not depend on the weights), or
--shape small (4 layers, 512 wide).

  packing  the length profile (whole articles) packed into rows of 2,048 and 8,192 tokens:
           this project's LPFHP and (2,048 only: minutes at 8,192) LP, K chosen from the
           lengths, against TRL's best-fit-decreasing
           (trl.data_utils.pack_dataset, strategy "bfd"): real tokens / row tokens
  leak     TRL's packing (SFTConfig(packing=True)) rows run as TRL's compute_loss runs them
           (use_cache=False: transformers 5.x builds a block-causal mask from the restarting
           position ids, with any attention backend) and, for contrast, with the model's
           default use_cache=True (causal over the whole row). Reported for each: the share
           of attention weight that crosses into another sequence in the random model, and
           the largest logit difference of a sequence against itself run alone
  sft      training tokens/s over --steps optimizer steps (after one warm-up step): TRL's
           SFTTrainer without packing (batches padded to their longest, completion-only
           loss) against transformers' Trainer over hf_integration.trainer.pack_dataset's packs with
           PackedFamilyModel (the same loss, sequences kept apart), the same examples per
           step; real (non-padding) tokens counted in both. The same arithmetic both ways:
           TRL's own defaults (bf16 autocast, gradient checkpointing) are set as ours are;
           --bf16 runs both in bf16. --spread gives the bodies a spread of lengths.
  peers    best against best: TRL's SFTTrainer with its own packing (packing=True: BFD,
           padding-free) at each --rows-per-step and without packing at its default batch of
           8, against Trainer over this project's packs at the same rows per step (peers_part)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
        "intermediate_size": 3072}  # fmt: skip
SHAPES = {"base": BASE, "small": {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
                                  "num_key_value_heads": 4, "intermediate_size": 1536}}  # fmt: skip


def headline_pairs(body_chars: int, spread: bool = False, articles: int | None = None) -> list[dict]:
    """{"prompt", "completion"} per BBC article (the first `articles`, all by default): its body
    (cut at body_chars, or with spread at a random 5-100% of it, seeded), its headline."""
    rng = np.random.default_rng(0)
    from packed_transformers.data.assets import corpus_files
    from packed_transformers.data.create_pretraining_data import read_document

    pairs = []
    for path in corpus_files()[:articles]:
        text, _ = read_document(path)
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if len(lines) < 2:
            continue
        cut = int(body_chars * rng.uniform(0.05, 1.0)) if spread else body_chars
        body = " ".join(lines[1:])[:cut]
        pairs.append(
            {"prompt": f"Write a headline for this article:\n{body}\nHeadline:", "completion": " " + lines[0]}
        )
    return pairs


def bpe_tokenizer(texts: list[str], vocab: int = 16000):
    """A byte-level BPE of a decoder's kind learned from `texts` (BOS first, EOS and pad)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   model_max_length=8192)  # fmt: skip


def encoded(pairs, tokenizer, max_length: int):
    """finetune.causal_lm_task's tokens and labels (-100 on the prompt) of the pairs."""
    from packed_transformers.finetune.causal_lm_task import PromptCompletions, encode_examples

    examples = PromptCompletions([p["prompt"] for p in pairs], [p["completion"] for p in pairs],
                                 [f"pair {i}" for i in range(len(pairs))])  # fmt: skip
    return encode_examples(examples, tokenizer, max_length, "truncate")


# ----- packing efficiency ---------------------------------------------------------------------
def packing_part(lengths: np.ndarray) -> list[dict]:
    from datasets import Dataset
    from trl.data_utils import pack_dataset as trl_pack

    from packed_transformers.packs.tokenized import pack_examples

    rows = []
    for width in (2048, 8192):
        kept = np.minimum(lengths, width)  # longer examples are truncated to the row, as TRL's BFD cuts them
        real = int(kept.sum())
        row = {"pack_length": width, "sequences": len(lengths), "tokens": real,
               "truncated": int((lengths > width).sum())}  # fmt: skip
        # LP's columns grow with the row length: at 8,192 tokens it runs for many minutes
        for algorithm in ("lpfhp", "lp") if width <= 2048 else ("lpfhp",):
            started = time.perf_counter()
            table = pack_examples(kept, width, None, algorithm, seed=0)
            row[f"ours_{algorithm}"] = real / (len(table) * width)
            row[f"ours_{algorithm}_K"] = int(table.shape[1])
            row[f"ours_{algorithm}_seconds"] = time.perf_counter() - started
        data = Dataset.from_dict({"input_ids": [[1] * int(n) for n in kept]})
        started = time.perf_counter()
        packed = trl_pack(data, width, strategy="bfd")
        row["trl_bfd"] = real / (len(packed) * width)
        row["trl_bfd_seconds"] = time.perf_counter() - started
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ----- what TRL's packing lets leak -----------------------------------------------------------------
def leak_part(examples, folder: Path, width: int = 512, rows: int = 4) -> dict:
    """TRL's BFD rows of `width` tokens, each run as TRL's compute_loss runs it (use_cache=False:
    transformers builds a block-causal mask from the restarting position ids) and with the
    model's default use_cache=True (causal over the whole row): the attention weight that
    crosses into another sequence, and each sequence's logits against the sequence alone."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.data_utils import pack_dataset as trl_pack

    data = Dataset.from_dict({"input_ids": [t.tolist()[:width] for t in examples.token_ids]})
    packed = trl_pack(data, width, strategy="bfd")

    def layout(row):  # TRL's packs name each sequence's length: -> sequence number, position per token
        sequence = np.repeat(np.arange(len(row["seq_lengths"])), row["seq_lengths"])
        positions = np.concatenate([np.arange(n) for n in row["seq_lengths"]])
        return sequence, positions

    crossing = allowed = 0
    for row in packed:
        sequence, _ = layout(row)
        same = sequence[:, None] == sequence[None, :]
        causal = np.tril(np.ones_like(same, dtype=bool))
        crossing += int((causal & ~same).sum())
        allowed += int(causal.sum())
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    measured = {}
    # TRL's SFTTrainer.compute_loss runs the model with use_cache=False: transformers 5.x then
    # builds a block-causal mask from the restarting position ids (masking_utils'
    # find_packed_sequence_indices); with the model's default use_cache=True it does not.
    for name, use_cache in (("as_trl_trains", False), ("default_use_cache", True)):
        mass, total, worst = 0.0, 0.0, 0.0
        with torch.inference_mode():
            for row in list(packed)[:rows]:
                ids = torch.tensor([row["input_ids"]])
                sequence, positions = (torch.as_tensor(a) for a in layout(row))
                other = (sequence[:, None] != sequence[None, :]).float()
                out = model(
                    input_ids=ids, position_ids=positions[None], output_attentions=True, use_cache=use_cache
                )
                for layer in out.attentions:  # [1, heads, S, S]
                    mass += float((layer[0] * other).sum())
                    total += float(layer[0].sum())
                start = 0  # each sequence of the row against the sequence run alone
                for length in row["seq_lengths"]:
                    alone = model(input_ids=ids[:, start : start + length], use_cache=False).logits
                    worst = max(worst, float((out.logits[:, start : start + length] - alone).abs().max()))
                    start += length
        measured[name] = {
            "crossing_attention_weight_share": mass / total,
            "max_abs_logit_diff_vs_alone": worst,
        }
    result = {"rows": len(packed), "pack_length": width, "crossing_pair_share_if_causal_over_the_row": crossing / allowed,
              "rows_measured": rows, **measured}  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


# ----- SFT speed --------------------------------------------------------------------------------------
class StepClock:
    """A Trainer callback: seconds of every optimizer step after the first (warm-up)."""

    def __init__(self):
        self.seconds, self.steps = 0.0, 0

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock.started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step > 1:
                    clock.seconds += time.perf_counter() - clock.started
                    clock.steps += 1

        return Callback()


def counting(collator, batches: list):
    """The collator, noting each batch's (real tokens, row tokens) in the order the loader
    makes them (step k trains batch k; the loader may make one more ahead)."""

    def collate(features):
        batch = collator(features)
        if "attention_mask" in batch:
            real = int(batch["attention_mask"].sum())
        elif "sequence_ids" in batch:
            real = int((batch["sequence_ids"] > 0).sum())
        else:  # TRL's padding-free rows: one flattened row, every token real
            real = int(batch["input_ids"].numel())
        batches.append((real, int(batch["input_ids"].numel())))
        return batch

    return collate


def step_figures(clock: StepClock, batches: list) -> dict:
    """Tokens of the timed steps (2 .. steps + 1) over their seconds."""
    timed = batches[1 : 1 + clock.steps]
    tokens, row_tokens = sum(b[0] for b in timed), sum(b[1] for b in timed)
    return {"seconds": clock.seconds, "steps": clock.steps, "tokens": tokens, "row_tokens": row_tokens,
            "padding_fraction": 1 - tokens / row_tokens, "tokens_per_second": tokens / clock.seconds}  # fmt: skip


def sft_part(pairs, examples, folder: Path, steps: int, batch: int, pack_length: int, bf16: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    from packed_transformers.hf_integration.trainer import PackedDataCollator, pack_dataset
    from packed_transformers.model.family_model import PackedFamilyModel

    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        # the same arithmetic both ways: TRL's defaults (bf16 autocast, gradient checkpointing)
        # set as ours are, bf16 in both with --bf16
        common = dict(output_dir=scratch, max_steps=steps + 1, learning_rate=1e-5, report_to=[], use_cpu=True,
                      save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0, bf16=bf16,
                      gradient_checkpointing=False)  # fmt: skip
        # TRL: the prompt/completion pairs as given, completion-only loss, no packing
        clock, batches = StepClock(), []
        torch.manual_seed(0)
        config = SFTConfig(**common, per_device_train_batch_size=batch, packing=False, max_length=512,
                           completion_only_loss=True, dataloader_drop_last=True)  # fmt: skip
        trainer = SFTTrainer(model=str(folder), args=config, train_dataset=Dataset.from_list(pairs),
                             processing_class=AutoTokenizer.from_pretrained(folder), callbacks=[clock.callback()])  # fmt: skip
        trainer.data_collator = counting(trainer.data_collator, batches)
        trainer.train()
        results["trl"] = step_figures(clock, batches)
        print("TRL SFTTrainer (no packing):", json.dumps(results["trl"]), flush=True)
        # ours: the same examples per step, packed into rows of 512 tokens
        data = Dataset.from_dict({"input_ids": [t.tolist() for t in examples.token_ids],
                                  "labels": [t.tolist() for t in examples.label_ids]})  # fmt: skip
        packs = pack_dataset(data, "causal_lm", pack_length, verbose=False)
        rows = max(1, round(batch * len(packs) / len(data)))
        clock, batches = StepClock(), []
        torch.manual_seed(0)
        model = PackedFamilyModel.from_pretrained(folder, "causal_lm")
        arguments = TrainingArguments(**common, per_device_train_batch_size=rows, dataloader_drop_last=True)
        trainer = Trainer(model=model, args=arguments, train_dataset=packs,
                          data_collator=counting(PackedDataCollator(), batches), callbacks=[clock.callback()])  # fmt: skip
        trainer.train()
        results["packed"] = {**step_figures(clock, batches), "rows_per_step": rows}
        print("Trainer on packs:", json.dumps(results["packed"]), flush=True)
    results["speedup_tokens_per_second"] = (
        results["packed"]["tokens_per_second"] / results["trl"]["tokens_per_second"]
    )
    print(f"packed / TRL: {results['speedup_tokens_per_second']:.2f}x tokens/s", flush=True)
    return results


def peers_part(pairs, examples, folder: Path, steps: int, rows_list, pack_length: int, bf16: bool) -> dict:
    """Best against best: TRL's SFTTrainer as its users run it, with its packing
    (SFTConfig(packing=True): best-fit decreasing into rows of pack_length, padding-free
    batches, completion-only loss) at each rows-per-step of `rows_list` and without packing at
    its default batch of 8, against Trainer over this project's packs at the same rows per step.
    Training tokens/s over `steps` steps after a warm-up step, real tokens counted."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    from packed_transformers.hf_integration.trainer import PackedDataCollator, pack_dataset
    from packed_transformers.model.family_model import PackedFamilyModel

    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        common = dict(output_dir=scratch, max_steps=steps + 1, learning_rate=1e-5, report_to=[], use_cpu=True,
                      save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0, bf16=bf16,
                      gradient_checkpointing=False, dataloader_drop_last=True)  # fmt: skip

        def trl(name, **settings):
            clock, batches = StepClock(), []
            torch.manual_seed(0)
            trainer = SFTTrainer(model=str(folder), args=SFTConfig(**common, completion_only_loss=True, **settings),
                                 train_dataset=Dataset.from_list(pairs),
                                 processing_class=AutoTokenizer.from_pretrained(folder), callbacks=[clock.callback()])  # fmt: skip
            trainer.data_collator = counting(trainer.data_collator, batches)
            trainer.train()
            results[name] = step_figures(clock, batches)
            print(name, json.dumps(results[name]), flush=True)

        trl("trl_no_packing_batch_8", per_device_train_batch_size=8, packing=False, max_length=512)
        data = Dataset.from_dict({"input_ids": [t.tolist() for t in examples.token_ids],
                                  "labels": [t.tolist() for t in examples.label_ids]})  # fmt: skip
        packs = pack_dataset(data, "causal_lm", pack_length, verbose=False)
        for rows in rows_list:
            trl(
                f"trl_packing_rows_{rows}",
                per_device_train_batch_size=rows,
                packing=True,
                max_length=pack_length,
            )
            clock, batches = StepClock(), []
            torch.manual_seed(0)
            model = PackedFamilyModel.from_pretrained(folder, "causal_lm")
            trainer = Trainer(model=model, args=TrainingArguments(**common, per_device_train_batch_size=rows),
                              train_dataset=packs, data_collator=counting(PackedDataCollator(), batches),
                              callbacks=[clock.callback()])  # fmt: skip
            trainer.train()
            results[f"packed_rows_{rows}"] = step_figures(clock, batches)
            print(f"packed_rows_{rows}", json.dumps(results[f"packed_rows_{rows}"]), flush=True)
    best = {kind: max(v["tokens_per_second"] for k, v in results.items() if k.startswith(kind))
            for kind in ("trl", "packed")}  # fmt: skip
    results["best_packed_over_best_trl"] = best["packed"] / best["trl"]
    print(f"best packed / best TRL: {results['best_packed_over_best_trl']:.2f}x tokens/s", flush=True)
    return results


def main() -> int:
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts", nargs="+", choices=("packing", "leak", "sft", "peers"), default=["packing", "leak", "sft"]
    )
    parser.add_argument("--shape", choices=tuple(SHAPES), default="base", help="the random Llama's size")
    parser.add_argument("--rows-per-step", type=int, nargs="+", default=[1, 2, 4], help="peers: rows a step")
    parser.add_argument(
        "--examples", type=int, default=400, help="pairs trained on (sft) and measured (leak)"
    )
    parser.add_argument(
        "--body-chars", type=int, default=1200, help="an article's body is cut at this many characters"
    )
    parser.add_argument(
        "--spread",
        action="store_true",
        help="cut each body at a random 5-100%% of --body-chars instead (lengths spread as instructions' are)",
    )
    parser.add_argument(
        "--pack-length", type=int, default=1024, help="tokens per packed row (examples are cut at 512)"
    )
    parser.add_argument(
        "--bf16", action="store_true", help="bf16 autocast in both (TRL's default; fp32 otherwise)"
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--articles",
        type=int,
        default=None,
        help="read the first N BBC articles only (all by default; a smoke: 60)",
    )
    parser.add_argument("--batch", type=int, default=8, help="examples per optimizer step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    long_pairs = headline_pairs(10**6, articles=args.articles)  # whole articles: the packing profile
    pairs = headline_pairs(args.body_chars, spread=args.spread, articles=args.articles)
    tokenizer = bpe_tokenizer([p["prompt"] + p["completion"] for p in long_pairs])
    results = {"tokenizer_vocabulary": len(tokenizer), "articles": len(long_pairs)}
    if "packing" in args.parts:
        whole = encoded(long_pairs, tokenizer, 8192)
        results["packing"] = packing_part(whole.lengths)
    rng = np.random.default_rng(0)
    chosen = [pairs[i] for i in rng.choice(len(pairs), size=args.examples, replace=False)]
    examples = encoded(chosen, tokenizer, 512)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "llama"
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model("llama", **SHAPES[args.shape], vocab_size=len(tokenizer), pad_token_id=0,
                                                   bos_token_id=1, eos_token_id=2, max_position_embeddings=8192)  # fmt: skip
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        if "leak" in args.parts:
            results["leak"] = leak_part(examples, folder)
        if "sft" in args.parts:
            results["sft"] = sft_part(
                chosen, examples, folder, args.steps, args.batch, args.pack_length, args.bf16
            )
        if "peers" in args.parts:
            results["peers"] = peers_part(
                chosen, examples, folder, args.steps, args.rows_per_step, args.pack_length, args.bf16
            )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
