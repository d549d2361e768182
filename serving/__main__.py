"""`python -m serving --model DIR`: the server's entry point (serving/cli.py)."""

import sys

from serving.cli import main

sys.exit(main())
