"""`python -m serving --model DIR`: the server's entry point (serving/cli.py)."""

import sys

from common.preflight import exit_on_path_mistakes

exit_on_path_mistakes({"--model": "folder"})  # before torch is imported

from serving.cli import main  # noqa: E402

sys.exit(main())
