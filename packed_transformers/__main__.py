"""`python -m packed_transformers SUBCOMMAND ...`: the `packed` command (commands/packed.py)."""

import sys

from packed_transformers.commands.packed import main

if __name__ == "__main__":
    sys.exit(main())
