"""Errors the user can fix. The CLI prints them as one line, without a traceback."""


class UsageError(Exception):
    """A problem with the user's arguments, data, model or environment.

    The message names the argument, what was expected, what arrived and the fix.
    """
