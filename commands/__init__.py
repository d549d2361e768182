"""The commands: argv in, exit code out.

    packed      the one console command: `packed pack | verify | pretrain | train | predict |
                embed | serve | ...` (each subcommand runs its job's own main)
    predict     `packed predict` (also `python -m finetune.predict`)
    embed       `packed embed` (also `python -m finetune.embed`)
    parsers     their argument parsers, standard library only (answered before torch loads)

The top of the house: imports any room, and no room imports it (tests/test_house.py).
"""
