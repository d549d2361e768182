"""`python -m packed_transformers.serving --model DIR`: the server's entry point (serving/cli.py).
Run in a Python without the full install (the light one has no torch, transformers or FastAPI),
it says so in one line, as `packed serve` does (commands/packed.py), not in a traceback."""

import sys

from packed_transformers.common.preflight import exit_on_path_mistakes, missing_packages

exit_on_path_mistakes({"--model": "folder"})  # before torch is imported

# what the server imports that the light install leaves out
SERVER_NEEDS = ("torch", "transformers", "fastapi", "uvicorn")

try:
    from packed_transformers.serving.cli import main

    code = main()
except ModuleNotFoundError as err:
    missing = missing_packages(SERVER_NEEDS) if err.name in SERVER_NEEDS else None
    if missing is None:
        raise
    print(f"error: python -m packed_transformers.serving: {missing}", file=sys.stderr)
    code = 2
sys.exit(code)
