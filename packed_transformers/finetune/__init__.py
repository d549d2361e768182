"""Packed fine-tuning: classification, question answering, decoders' supervised fine-tuning
and contrastive training of embedding models, from a checkpoint opened through the door,
validated through inference/; rerankers (data.task rerank) through sentence-transformers' own
trainer, packed (hf_integration/rerank_train.py: `train` hands the config over).

    train          `python -m packed_transformers.finetune.train` / `packed train`: the run as named steps over a typed state
    config         the YAML schema and the command line (train_parser, standard library and YAML only)
    specs          data.task -> its job, picked once: the sources it reads, its input's reader, its trainer
    jobs           each task's input and Job (job_contract): classification, embedding; QA (qa_task), SFT (causal_lm_task)
    run_folder, checkpoint   the output folder, resume's checks, exact --resume, the run state's
                   fine-tuning part (FinetuneProgress)
    folder_writer  the fine-tuned folder written (read back by door/)
    errors         FinetuneError, Interrupted (a diverged run: components.run_state.Diverged, every job's)

    predict, embed, ray_job, serve   `python -m finetune.X` kept for scripts that name it: each
                   runs its command (commands/, ray_jobs/, serving/) as the main module, no logic

Uses door/, inference/, model/, optim/, data/, packing/, common/ and hf_integration/'s rerank job.
Never imports training/ (pretraining), serving/, ray_jobs/ or commands/ (tests/house/test_house.py).
"""
