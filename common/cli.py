"""What every command line of the project shares."""

from __future__ import annotations

import argparse
import copy


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
