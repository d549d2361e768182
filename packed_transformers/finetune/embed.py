"""`python -m packed_transformers.finetune.embed`: the name used before `packed embed`; commands/embed.py run here as
the main module (its checks before the imports included). No logic here."""

import runpy

if __name__ == "__main__":
    runpy.run_module("packed_transformers.commands.embed", run_name="__main__", alter_sys=True)
