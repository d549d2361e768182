"""The Hugging Face faces: packing for users of transformers' own tools.

    trainer    pack_dataset, PackedDataCollator, packed_metrics: datasets and Trainer
    pipeline   packed_pipeline: transformers' pipelines' calls, packed underneath

Uses door/ and inference/. Never imports finetune/, ray_jobs/, serving/, commands/ or
training/ (tests/house/test_house.py).
"""
