"""The pieces every training run is built from (torchtitan's components/): the one training loop of
every run (loop: when to log, evaluate, checkpoint and stop; the runs are its jobs), the step's
arithmetic and loss sums (step), fine-tuning's micro-batches from packs/'s tables (batches),
replicas and host collectives (distributed), fine-tuning's steps shared by torchrun's processes
(replicas), FSDP2 per block and DCP (sharding), checkpoints and RNG state (checkpoint), the run
folder and its resume checks (run_folder), the run's state, the evaluation schedule, stop
conditions and exit codes (run_state), metrics, TensorBoard and the MLPerf log (observe,
mlperf_log), learning curves read back (curves), packed BERT shards in a resumable, replica-
disjoint order (data; batch_check, synthetic). The runs and their engines (training/) are built
on these. Never imports training/, door/, inference/, finetune/, serving/ or any room above
them.
"""
