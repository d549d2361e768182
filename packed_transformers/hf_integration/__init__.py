"""The Hugging Face faces: packing for users of transformers' own tools.

    trainer    pack_dataset, PackedDataCollator, packed_metrics: datasets and Trainer
    pipeline   packed_pipeline: transformers' pipelines' calls, packed underneath
    st_packing pack_sentence_transformer: a SentenceTransformer's transformer on packed rows,
               inside its own trainer, losses and encode

Uses door/, inference/, model/ and packs/; imports sentence-transformers nowhere. Never imports finetune/, ray_jobs/, serving/, commands/ or
training/ (tests/house/test_house.py).
"""
