"""The Hugging Face faces: packing for users of transformers' own tools.

    trainer    pack_dataset, PackedDataCollator, packed_metrics: datasets and Trainer
    pipeline   packed_pipeline: transformers' pipelines' calls, packed underneath
    st_packing pack_sentence_transformer, pack_cross_encoder: a SentenceTransformer's transformer
               (a CrossEncoder's classifier) on packed rows, inside its own trainer, losses, encode
               and predict
    rerank_train  `packed train` with data.task rerank: CrossEncoderTrainer over pack_cross_encoder,
               losses and evaluation from the config (its keys: RERANK_KEYS)

Uses door/, inference/, model/, data/ and packs/; imports sentence-transformers only in rerank_train's
run (the trainer it drives). Never imports finetune/, ray_jobs/, serving/, commands/ or training/
(tests/house/test_house.py).
"""
