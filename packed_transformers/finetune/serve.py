"""`python -m packed_transformers.finetune.serve`: an alias of `python -m packed_transformers.serving` (the server's own entry
point, serving/cli.py), kept so that commands written before the server had its own room
still work. Same options, same behaviour; no logic here.

The server is run as a module, not imported: finetune/ never imports serving/ (serving/
builds on finetune/, not the reverse; tests/house/test_module_rules.py)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("packed_transformers.serving", run_name="__main__", alter_sys=True)
