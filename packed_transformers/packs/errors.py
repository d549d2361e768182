"""User-facing errors of the packing library.

`PackingInputError` means the user gave bad input (a file, a histogram, an
option): the CLI prints its message and exits with code 2, without a traceback.
`PackingBugError` means a plan failed its own verification: a bug, never a user
error, so it is allowed to surface with a traceback.
"""


class PackingInputError(ValueError):
    """Bad user input: the message names the file, field or value that is wrong."""


class PackingBugError(AssertionError):
    """An algorithm produced an invalid plan. Raised, never returned."""
