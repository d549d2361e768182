"""Pretraining runs: BERT phase 2 (MLPerf style; run: a job of components.trainer) and decoders (decoder/: MLPerf
5.1's llama31_8b rules), each a registered spec the command picks once (specs), their config schemas, what a run needs on this machine (prerequisites),
the model built for a run (build) and runs compared (summary); the engines that run the steps
(CPU/CUDA, torchrun, pipeline stages, IPU) are engines/, below every run. The pieces a run is made
of (step, checkpoints, replicas, FSDP2 sharding and DCP, logs, data order) are components/.
Never imports door/, inference/, finetune/, serving/ or any room above it.
"""
