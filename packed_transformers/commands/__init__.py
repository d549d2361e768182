"""The commands: argv in, exit code out.

    packed      the one console command: `packed pack | verify | pretrain | train | predict |
                embed | serve | ...` (each subcommand runs its job's own module)
    predict     `packed predict` (also `python -m packed_transformers.finetune.predict`)
    embed       `packed embed` (also `python -m packed_transformers.finetune.embed`)
    parsers     their argument parsers, standard library only (answered before torch loads)

The top of the house: may import any room; no room imports it. Never holds a job's logic
beyond reading its arguments and writing its outputs (tests/house/test_house.py).
"""
