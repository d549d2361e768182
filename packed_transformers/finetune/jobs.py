"""What each fine-tuning task gives the shared loop (finetune.train): its data, its model,
how it is evaluated, written and saved, as one `Job`. Each task's reader (finetune.specs
registers them) reads and checks its input: a JobInput, the rows and the Job's builder; the
model is opened only once the whole input is read and batched. The loop names no task.

    classification      jsonl / BBC News -> labels checked -> tokens (the checkpoint's own
                        tokenizer, or WordPiece over a vocab.txt) -> the packed classifier
    question_answering  SQuAD -> context windows with span labels (finetune.qa_task) ->
                        this project's packed QA head
    causal_lm           prompt/completion JSON lines -> tokens, the prompt's labels -100
                        (finetune.causal_lm_task) -> a decoder's packed causal LM
    embedding           (anchor, positive[, negative]) JSON lines -> a step: batch_size pairs in
                        random order (the sampler's, as sentence-transformers' trainer draws
                        them: the batch is the negatives), its texts packed into rows ->
                        MultipleNegativesRankingLoss (model.embedding) -> a sentence-transformers
                        folder; validated as retrieval over the held-out pairs
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from packed_transformers.common.files import atomic_folder
from packed_transformers.components.run_state import Diverged
from packed_transformers.data.assets import resolve_asset
from packed_transformers.data.classification_data import (
    Examples,
    TokenizedExamples,
    encode_labels,
    label_names_of,
    read_bbc_news,
    read_jsonl,
    split_by_seed,
)
from packed_transformers.data.tokenizer import load_tokenizer
from packed_transformers.door.folder import FolderTokenizer, check_vocab_file
from packed_transformers.door.loaded import tokenize_examples
from packed_transformers.door.opener import ForTraining, open_folder
from packed_transformers.finetune.errors import FinetuneError
from packed_transformers.finetune.folder_writer import save_finetuned
from packed_transformers.finetune.job_contract import ANCHOR_LOSS, Job, JobInput
from packed_transformers.inference.predictions import predict_logits, score, write_predictions
from packed_transformers.model.opening import ModelOptions, qa_fine_tuning_refusal
from packed_transformers.packs.batching import BatchingSpec
from packed_transformers.packs.rows import PAIR_SLOTS, pair_rows

log = logging.getLogger("finetune")


@dataclass
class Task:
    """Everything the loop needs about the data, tokenized, in input order."""

    train: TokenizedExamples
    validation: TokenizedExamples
    label_names: list[str]
    vocab_file: Path | None  # None: the checkpoint's own tokenizer (tokenizer.json)
    # the tokenizer the rows were made with, built once: the checkpoint's own, or WordPiece
    # over the vocab.txt; handed to the door, whose LoadedModel carries it
    tokenizer: FolderTokenizer


def read_examples(data: dict, path: str) -> Examples:
    if data["source"] == "bbc_news":
        return read_bbc_news(path)
    return read_jsonl(path, data["text_field"], data["pair_field"], data["label_field"])


def prepare_task(config: dict, checkpoint_config: dict | None = None) -> Task:
    """Read, check and tokenize the train and validation examples: with the checkpoint's
    own tokenizer (tokenizer.json: its normalizer, specials and pair template, as
    transformers tokenizes for it) where it has one and data.vocab_file is not set, else
    BERT WordPiece over the vocab.txt. checkpoint_config: the checkpoint's config.json as
    read (None: read where needed)."""
    data = config["data"]
    checkpoint = Path(resolve_asset(config["model"]["init_checkpoint"]))
    # The checkpoint's own tokenizer as transformers builds it: tokenizer.json, or a vocab.txt
    # with tokenizer_config.json (its do_lower_case: a cased model stays cased).
    own_tokenizer = data["vocab_file"] is None and (
        (checkpoint / "tokenizer.json").is_file() or (checkpoint / "tokenizer_config.json").is_file()
    )
    if own_tokenizer:
        from packed_transformers.door.folder import open_tokenizer

        opened = open_tokenizer(checkpoint, checkpoint_config)
        vocab_file, tokenizer, vocab, token_types = None, opened.tokenizer, None, opened.token_types
        carried = opened
    else:
        vocab_file = Path(resolve_asset(data["vocab_file"]) or checkpoint / "vocab.txt")
        if not vocab_file.is_file():
            raise FinetuneError(f"{vocab_file}: no vocabulary file (set data.vocab_file)")
        check_vocab_file(checkpoint, vocab_file, checkpoint_config)
        tokenizer, vocab = load_tokenizer(vocab_file)
        token_types = True
        carried = FolderTokenizer(tokenizer, token_types, vocab=vocab)

    examples = read_examples(data, resolve_asset(data["train_file"]))
    for note in examples.notes:
        log.info("note: %s", note)
    if data["validation_file"] is None:
        train_rows, val_rows = split_by_seed(len(examples), data["validation_fraction"], data["split_seed"])
        train, validation = examples.subset(train_rows), examples.subset(val_rows)
    else:
        train, validation = examples, read_examples(data, data["validation_file"])
    label_names = data["labels"] or label_names_of(train)
    splits = []
    for name, part in (("train", train), ("validation", validation)):
        labels = encode_labels(part, label_names, data["multi_label"])
        length, too_long = data["max_sequence_length"], data["too_long"]
        tokenized = tokenize_examples(part, labels, length, too_long, tokenizer, vocab, token_types)
        if tokenized.truncated:
            log.warning(
                "%s: %d of %d examples truncated to %d tokens",
                name,
                tokenized.truncated,
                len(tokenized),
                data["max_sequence_length"],
            )
        splits.append(tokenized)
    return Task(splits[0], splits[1], label_names, vocab_file, carried)


def build_classifier(config: dict, task: Task, checkpoint_config: dict | None = None):
    """The packed classifier over the checkpoint: this project's packed BERT for a BERT
    folder, transformers' own modules with packed attention for the other encoder
    families (model/families.py)."""
    model_cfg, data = config["model"], config["data"]
    checkpoint = resolve_asset(model_cfg["init_checkpoint"])
    torch.manual_seed(config["training"]["seed"])  # the classifier's init
    problem_type = "multi_label_classification" if data["multi_label"] else "single_label_classification"
    labels = {"id2label": dict(enumerate(task.label_names)),
              "label2id": {name: i for i, name in enumerate(task.label_names)}}  # fmt: skip
    options = ModelOptions(
        new_head=True,  # fine-tuning: the classifier may be new; the encoder must be whole
        attention_backend=model_cfg["attention_backend"],
        dropout={"hidden": model_cfg["hidden_dropout"], "attention": model_cfg["attention_dropout"],
                 "classifier": model_cfg["classifier_dropout"]},
        config={"num_labels": len(task.label_names), "problem_type": problem_type, **labels},
    )  # fmt: skip
    opened = open_folder(  # through the door: one line (ExampleError) for a folder that cannot be loaded
        checkpoint, ForTraining("classification", options, checkpoint_config, f"model.init_checkpoint {checkpoint}",
                                tokenizer=task.tokenizer),
    )  # fmt: skip
    longest = int(max(task.train.lengths.max(), task.validation.lengths.max()))
    if longest > opened.max_length:
        raise FinetuneError(
            f"data.max_sequence_length: examples of {longest} tokens exceed the checkpoint's "
            f"{opened.max_length} positions"
        )
    return opened


def classification_job(config: dict, checkpoint_config: dict | None = None) -> JobInput:
    task = prepare_task(config, checkpoint_config)

    def build() -> Job:  # the model, once the input above is read and checked
        opened = build_classifier(config, task, checkpoint_config)
        multi_label = config["data"]["multi_label"]

        def evaluate(model, batcher):
            logits, inference = predict_logits(model, task.validation, batcher)
            if not np.isfinite(logits).all():
                raise Diverged(
                    "validation logits are not finite: the run diverged (lower optim.lr?); nothing saved"
                )
            return score(logits, task.validation.labels, multi_label), inference, logits

        return Job(
            task.train, task.validation, opened, evaluate,
            lambda output, logits: write_predictions(output / "validation_predictions.jsonl", logits,
                                                     task.label_names, multi_label),
            lambda model, folder: save_finetuned(model, config, task.label_names, task.vocab_file, folder,
                                                 tokenizer_source=Path(resolve_asset(config["model"]["init_checkpoint"]))),
            f"{len(task.label_names)} classes",
        )  # fmt: skip

    return JobInput(task.train, task.validation, build)


def qa_job(config: dict, checkpoint_config: dict | None = None) -> JobInput:
    from packed_transformers.finetune.qa_task import build_qa_model, prepare_qa
    from packed_transformers.inference.question_answering import (
        answer_questions,
        answer_settings,
        score_answers,
        write_answer_files,
    )

    checkpoint = resolve_asset(config["model"]["init_checkpoint"])
    refusal = qa_fine_tuning_refusal(checkpoint)
    if refusal:
        raise FinetuneError(f"model.init_checkpoint {checkpoint}: {refusal}")
    vocab_file = Path(resolve_asset(config["data"]["vocab_file"]) or Path(checkpoint) / "vocab.txt")
    if not vocab_file.is_file():
        raise FinetuneError(f"{vocab_file}: no vocabulary file (set data.vocab_file)")
    check_vocab_file(Path(checkpoint), vocab_file, checkpoint_config)
    wordpiece, vocab = load_tokenizer(vocab_file)
    train, validation, tokenizer = prepare_qa(config, vocab, resolve_asset)
    carried = FolderTokenizer(wordpiece, True, transformers_tokenizer=tokenizer, vocab=vocab)

    def build() -> Job:  # the model, once the input above is read and checked
        opened = build_qa_model(config, checkpoint, checkpoint_config, carried)
        longest = int(max(train.windows.lengths.max(), validation.windows.lengths.max()))
        if longest > opened.max_length:
            raise FinetuneError(
                f"data.max_sequence_length: windows of {longest} tokens exceed the checkpoint's "
                f"{opened.max_length} positions"
            )
        qa = config["qa"]
        settings = answer_settings(qa)

        def evaluate(model, batcher):
            answers, inference = answer_questions(model, validation, batcher, settings)
            return score_answers(answers, validation.examples, qa["version_2_with_negative"]), inference, answers  # fmt: skip

        return Job(
            train.windows,
            validation.windows,
            opened,
            evaluate,
            lambda output, answers: write_answer_files(
                output / "validation_predictions.json", answers, validation.examples
            ),
            lambda model, folder: save_finetuned(model, config, None, vocab_file, folder, tokenizer),
            f"{len(train.examples)} / {len(validation.examples)} questions",
        )

    return JobInput(train.windows, validation.windows, build)


def contrastive_job(config: dict, checkpoint_config: dict | None = None) -> JobInput:
    """A sentence-transformers folder (or an encoder given model.pooling) trained on pairs."""
    from packed_transformers.data.classification_data import PAIR_ROLES, TokenizedPairs, read_pairs
    from packed_transformers.door.opener import ForEmbedding
    from packed_transformers.door.st_folder import transformer_module_path
    from packed_transformers.model import embedding as contrastive

    data, model_cfg, batching = config["data"], config["model"], config["batching"]
    checkpoint, fields = (
        Path(resolve_asset(model_cfg["init_checkpoint"])),
        {r: data[f"{r}_field"] for r in PAIR_ROLES},
    )
    texts, where = read_pairs(resolve_asset(data["train_file"]), fields)
    held, held_where = (
        read_pairs(data["validation_file"], fields) if data["validation_file"] else (texts, where)
    )
    split = split_by_seed(len(where), data["validation_fraction"], data["split_seed"])
    train_rows, val_rows = (
        split if data["validation_file"] is None else (range(len(where)), range(len(held_where)))
    )
    # the folder's tokenizer and cut (sentence-transformers' max_seq_length), as embed reads texts
    reader = open_folder(
        checkpoint, ForEmbedding(model_cfg["pooling"], max_length=data["max_sequence_length"])
    )

    def tokenized(source, place, rows) -> TokenizedPairs:
        cut = [reader.tokenize_texts([source[r][i] for i in rows], [f"{place[i]}: {r}" for i in rows])
               for r in PAIR_ROLES if source[r]]  # fmt: skip
        return TokenizedPairs([ids for ids, _ in cut], sum(n for _, n in cut))

    if min(len(train := tokenized(texts, where, train_rows)) - 1, len(validation := tokenized(held, held_where, val_rows))) < 1:  # fmt: skip
        raise FinetuneError(
            f"{len(train)} training, {len(validation)} validation pairs: in-batch negatives need 2"
        )

    width = max(
        batching["pack_length"] or reader.max_length, int(max(len(t) for role in train.roles for t in role))
    )

    def build() -> Job:  # the model, once the input above is read and checked
        torch.manual_seed(config["training"]["seed"])
        options = ModelOptions(attention_backend=model_cfg["attention_backend"], pooling=model_cfg["pooling"], dropout={"hidden": model_cfg["hidden_dropout"], "attention": model_cfg["attention_dropout"]})  # fmt: skip
        opened = open_folder(checkpoint, ForTraining("embedding", options, checkpoint_config, f"model.init_checkpoint {checkpoint}"))  # fmt: skip
        opened.model = contrastive.PackedContrastive(opened.model, **config["contrastive"])

        def rows_of(pairs: TokenizedPairs, table) -> dict:  # the step's texts packed: rows and each text's slot  # fmt: skip
            # none: a process a step left without a pair packs one text, scored nowhere
            chosen = table[table >= 0]
            rows = pair_rows(pairs.roles, chosen if chosen.size else np.zeros(1, np.int64), width, batching["max_sequences_per_pack"], batching["algorithm"], int(chosen[0]) if chosen.size else 0)  # fmt: skip
            return {name: torch.from_numpy(value[:0] if name in PAIR_SLOTS and not chosen.size else value) for name, value in rows.items()}  # fmt: skip

        def padding(sequence_ids: list) -> float:  # of packed rows, from their sequence ids (0: padding)
            return 1.0 - sum(int((r > 0).sum()) for r in sequence_ids) / max(
                sum(r.numel() for r in sequence_ids), 1
            )

        def evaluate(model, batcher):  # the held-out pairs as retrieval, and their in-batch loss
            started, found, loss_sum, seen = time.perf_counter(), ([], []), 0.0, []
            with torch.inference_mode():
                for table in batcher.epoch(0, shuffle=False):
                    batch = {k: v.to(next(model.parameters()).device) for k, v in rows_of(validation, table).items()}  # fmt: skip
                    seen.append(batch["sequence_ids"])
                    slots = [batch.pop(name) for name in PAIR_SLOTS if name in batch]
                    flat = model.eval()(**batch)["embeddings"].reshape(-1, model.dimension).float()
                    loss_sum += float(contrastive.ranking_loss(flat[slots[0]], flat[torch.cat(slots[1:])], model.scale, model.symmetric)[0].sum())  # fmt: skip
                    for kept, slot in zip(found, slots):
                        kept.append(flat[slot].cpu().numpy())
            seconds, scores = time.perf_counter() - started, contrastive.retrieval_scores(*map(np.concatenate, found))  # fmt: skip
            return {"loss": loss_sum / len(validation), **scores}, {"examples": len(validation), "seconds": seconds,
                    "padding_fraction": padding(seen), "examples_per_second": len(validation) / seconds}, None  # fmt: skip

        def save(model, folder: Path) -> None:  # the starting folder's modules, the trained encoder's weights
            from safetensors.torch import save_file

            with atomic_folder(folder) as written:
                shutil.copytree(checkpoint, written, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))  # fmt: skip
                target = written / transformer_module_path(checkpoint) / "model.safetensors"
                save_file(contrastive.encoder_weights(model.embedder), str(target), metadata={"format": "pt"})

        return Job(
            train, validation, opened, evaluate, lambda output, outputs: None, save,
            f"{len(train):,} pairs{' with hard negatives' if len(train.roles) > 2 else ''}",
            collate=lambda pairs, table, _width, with_labels=True: rows_of(pairs, table),
            padding=lambda tables: padding([rows_of(train, table)["sequence_ids"] for table in tables]),
            loss=ANCHOR_LOSS,
        )  # fmt: skip

    return JobInput(
        train, validation, build, lambda config, batch_size: BatchingSpec("dynamic", batch_size, width)
    )
