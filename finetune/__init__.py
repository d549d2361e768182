"""Packed fine-tuning and inference: classification, question answering, token
classification, sentence embeddings; the Hugging Face integration.

    config      the fine-tuning YAML schema
    batching    padded / dynamic / uniform / packed batch tables; rows.py: tables -> rows -> input order
    folder      the fine-tuned model folder (weights + vocab.txt + finetune.json), written and read
    train       `python -m finetune.train`: fine-tune (classification or QA), validate, save
    predict     `python -m finetune.predict`: any batching mode, predictions in input order
    embed       `python -m finetune.embed`: a JSON-lines file -> an .npy of embeddings (embedding.py)
    precision   float32 / bfloat16 inference, refused where the device has no bf16
    hf, hf_pipeline   pack_dataset / PackedDataCollator for Trainer; packed_pipeline
    report      `python -m finetune.report`: runs side by side
    serve       an alias of `python -m serving` (the server lives in serving/, which builds on this)

Uses model/, data/, packing/ and common/; never training/ (pretraining) nor serving/.
"""
