"""How a fine-tuning run ends when it does not succeed; each maps to one line and an exit code
in `finetune.train.main`: FinetuneError 2 (the user's input), Diverged 3 (every job's one class,
components.run_state.Diverged), Interrupted 128 + the signal."""

from __future__ import annotations


class FinetuneError(ValueError):
    """A run that cannot start (vocabulary mismatch, existing output); CLI exit code 2."""


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM stopped the run; the message says what was kept."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
