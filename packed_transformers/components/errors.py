"""The error every pretraining check raises."""


class RunError(ValueError):
    """A run that cannot start; the message says what to fix. CLI exit code 2."""
