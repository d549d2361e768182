"""Decoder pretraining as MLPerf Training 5.1 runs it (llama31_8b): a causal LM of any packed
decoder family on `packed pack-documents` rows (the reference's concatenated layout: Closed
division; document-masked packs: Open), AdamW, cosine with linear warmup, eval log perplexity,
MLPerf log.

    config       the schema of configs/pretrain_decoder_*.yaml (model.family selects this run),
                 and which division a layout allows (division_fault)
    model        a family's causal LM from a config (random init, on the meta device when
                 sharded) or a folder, on packed rows
    memory_plan  `--plan`: the memory per rank and the GPUs a config needs, nothing allocated
    run          the loop: steps, evaluation, checkpoints, logs (run_pretraining.py calls it)

Its rows come in order from components.decoder_data; shares components/' pieces (run folder,
checkpoints, distributed helpers, metrics, the MLPerf log); never imports door/, inference/,
finetune/, serving/ or any room above training/.
"""
