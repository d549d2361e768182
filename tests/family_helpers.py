"""Tiny random models of every packed encoder family, with a real tokenizer of the family's
kind (WordPiece, byte-level BPE or Unigram) learned once from the shipped BBC text and stored
(tests/fixtures/tokenizers/), saved as transformers' save_pretrained writes them (no
finetune.json, no vocab.txt)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, PreTrainedTokenizerFast

from packed_transformers.data.assets import corpus_glob
from packed_transformers.data.embedding_texts import bbc_articles, texts_of

from .fixture_tokenizers import encoder_tokenizer

SENTENCES = texts_of(bbc_articles(corpus_glob())[:5], "sentences")
TEXTS = [s for s in SENTENCES if 3 < len(s.split()) < 30][:18]
ROBERTA_STYLE = ("roberta", "xlm-roberta", "camembert", "mpnet")
# the tokenizer kind each family ships with
KIND = {"bert": "wordpiece", "electra": "wordpiece", "distilbert": "wordpiece", "nomic_bert": "wordpiece",
        "mpnet": "wordpiece", "roberta": "bpe", "modernbert": "bpe", "xlm-roberta": "unigram",
        "camembert": "unigram", "deberta-v2": "unigram"}  # fmt: skip
FAMILIES = tuple(KIND)
TYPED = ("bert", "electra")  # families whose tokenizers hand the model token_type_ids
TASKS = ("classification", "token_classification", "question_answering", "embedding")
AUTO = {"classification": "AutoModelForSequenceClassification", "token_classification": "AutoModelForTokenClassification",
        "question_answering": "AutoModelForQuestionAnswering", "embedding": "AutoModel"}  # fmt: skip


def family_tokenizer(model_type: str) -> PreTrainedTokenizerFast:
    """A fast tokenizer of the family's kind and template, learned once from the BBC sentences
    (tests/fixtures/learn_tokenizers.py; the same bytes in every process)."""
    roberta = model_type in ROBERTA_STYLE
    specials = (
        ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        if roberta
        else ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    )
    bos, pad, eos, unk, mask = (
        specials if roberta else (specials[2], specials[0], specials[3], specials[1], specials[4])
    )
    tokenizer = encoder_tokenizer(KIND[model_type], "roberta" if roberta else "bert")
    names = (
        {"model_input_names": ["input_ids", "token_type_ids", "attention_mask"]}
        if model_type in TYPED
        else {}
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=bos, eos_token=eos, cls_token=bos, sep_token=eos, pad_token=pad,
        unk_token=unk, mask_token=mask, model_max_length=96, **names,
    )  # fmt: skip


def tiny_config(model_type: str, tokenizer, task: str, **extra):
    """A 2-layer, 32-wide config of the family, dropout off."""
    size = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
    if model_type == "distilbert":
        size = {"dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64}
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.cls_token_id,
        "eos_token_id": tokenizer.sep_token_id,
    }
    kw = {**size, **ids, "vocab_size": len(tokenizer), "max_position_embeddings": 128}
    if model_type in ROBERTA_STYLE:
        kw["max_position_embeddings"] = 130  # positions from pad + 1
    if model_type == "modernbert":
        kw.update(global_attn_every_n_layers=2, local_attention=8, cls_token_id=tokenizer.cls_token_id,
                  sep_token_id=tokenizer.sep_token_id)  # fmt: skip
    if model_type == "deberta-v2":
        kw.update(relative_attention=True, position_buckets=16, max_relative_positions=32,
                  pos_att_type=["p2c", "c2p"], position_biased_input=False, type_vocab_size=0)  # fmt: skip
    if task == "question_answering":
        kw["num_labels"] = 2
    elif task != "embedding":
        kw["num_labels"] = 3
        kw["id2label"] = (
            {0: "O", 1: "B-X", 2: "I-X"} if task == "token_classification" else {0: "a", 1: "b", 2: "c"}
        )
    kw.update(extra)
    config = AutoConfig.for_model(model_type, **kw)
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout",
                "embedding_dropout", "mlp_dropout", "classifier_dropout", "seq_classif_dropout", "qa_dropout"):  # fmt: skip
        if hasattr(config, key):
            setattr(config, key, 0.0)
    return config


def save_family_folder(
    folder: Path, model_type: str, task: str, tokenizer=None, seed: int = 0, **extra
) -> Path:
    tokenizer = tokenizer or family_tokenizer(model_type)
    torch.manual_seed(seed)
    model = getattr(transformers, AUTO[task]).from_config(tiny_config(model_type, tokenizer, task, **extra))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
