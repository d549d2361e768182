"""Pretraining (BERT phase 2, MLPerf style): config schema, data loading, the step,
evaluation, checkpoints, logging, engines (CPU/CUDA, torchrun, pipeline, IPU). Never
imports door/, inference/, finetune/, serving/ or any room above it.
"""
