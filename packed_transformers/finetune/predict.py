"""`python -m packed_transformers.finetune.predict`: the name used before `packed predict`; commands/predict.py run here as
the main module (its checks before the imports included). No logic here."""

import runpy

if __name__ == "__main__":
    runpy.run_module("packed_transformers.commands.predict", run_name="__main__", alter_sys=True)
