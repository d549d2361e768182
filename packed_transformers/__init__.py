"""packed_transformers: sequence packing for transformers, with no cross-contamination.

The one name this project installs. Its rooms, each a folder whose own __init__.py says
its contract and what it never imports (ARCHITECTURE.md draws them):

    common/          small shared tools (files, CLI, config schema); imports no other room
    data/            raw text and shards in: tokenizers, MLPerf's data, JSON lines, SQuAD
    packing/         the offline packer (NNLSHP, SPFHP, LPFHP, LP) and the packed format
    model/           packed models equal to transformers' (BERT, encoder and decoder families)
    optim/           LAMB, AdamW groups, schedules, the packing adjustment
    training/        the pretraining run and its engines (torch, pipeline, IPU)
    door/            a folder described once and opened once
    inference/       every forward outside training (the Runner), embeddings, rows
    finetune/        packed fine-tuning: classification, QA, tokens, decoders' SFT
    hf_integration/  Hugging Face's Trainer and pipelines over packs
    ray_jobs/        embed / predict on a Ray cluster
    serving/         the HTTP server (TEI's and OpenAI's APIs)
    commands/        the `packed` command and its subcommands

Importing this package imports nothing heavy: each room is imported where it is used.
"""

__version__ = "0.3.0"
