"""`python -m packed_transformers.finetune.serve`: an alias of `python -m packed_transformers.serving`
(serving/cli.py), kept for commands written before the server had its own room; no logic here.
Run as a module, not imported: finetune/ never imports serving/ (tests/house/test_module_rules.py)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("packed_transformers.serving", run_name="__main__", alter_sys=True)
