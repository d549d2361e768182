"""Packed inference on a Ray cluster: the `--ray` jobs of predict and embed.

    job       the driver: plan, run, gather, the manifest (`python -m packed_transformers.finetune.ray_job` gathers)
    shards    the job's data on disk: chunks, shards, the exactly-once check, reuse
    actors    Ray Data's map_batches callables, one model per actor (opened through the door)

Ray is imported here and nowhere else. Uses door/ and inference/; never imports finetune/,
serving/, commands/ or training/ (tests/house/test_house.py).
"""
