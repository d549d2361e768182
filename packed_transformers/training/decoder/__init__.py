"""Decoder pretraining as MLPerf Training 5.1 runs it (llama31_8b): a causal LM of any packed
decoder family on `packed pack-documents` rows (document-masked packs, or the reference's
concatenated layout), AdamW, cosine with linear warmup, eval log perplexity, MLPerf log.

    config  the schema of configs/pretrain_decoder_*.yaml (model.family selects this run)
    data    rows -> per-rank micro-batches in a seeded, resumable order
    model   a family's causal LM from a config (random init) or a folder, on packed rows
    run     the loop: steps, evaluation, checkpoints, logs (run_pretraining.py calls it)

Shares training/'s pieces (run folder, checkpoints, distributed helpers, metrics, the MLPerf
log); never imports door/, inference/, finetune/, serving/ or any room above training/.
"""
