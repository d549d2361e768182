"""`python -m packed_transformers.serving --model DIR`: the server's entry point (serving/cli.py)."""

import sys

from packed_transformers.common.preflight import exit_on_path_mistakes

exit_on_path_mistakes({"--model": "folder"})  # before torch is imported

from packed_transformers.serving.cli import main  # noqa: E402

sys.exit(main())
