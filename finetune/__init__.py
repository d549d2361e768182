"""Packed fine-tuning and inference for sequence classification.

    config     the fine-tuning YAML schema
    batching   padded / dynamic / uniform / packed batch tables and their collation
    folder     the fine-tuned model folder (weights + vocab.txt + finetune.json), written and read
    train      `python -m finetune.train`: fine-tune, validate, time inference, save
    predict    `python -m finetune.predict`: any batching mode, predictions in input order
    report     `python -m finetune.report`: runs side by side

Uses model/, data/, packing/ and common/; never training/ (pretraining).
"""
