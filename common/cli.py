"""What every command line of the project shares."""

from __future__ import annotations

import argparse
import copy


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what a
    one-line `error:` quotes of a library's multi-line error."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` shows every option's default, documented or not, unless its help already
    names one; flags (default False) and options without a default show none."""

    def _format_action(self, action):
        shown = (
            action.option_strings
            and action.default is not None
            and action.default is not False
            and action.default is not argparse.SUPPRESS
            and "default" not in (action.help or "")
        )
        if shown:
            action = copy.copy(action)
            action.help = ((action.help or "") + " (default: %(default)s)").strip()
        return super()._format_action(action)
