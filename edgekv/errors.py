"""The one exception type a user can cause. The CLI turns it into one line and exit code 2."""


class EdgekvError(Exception):
    """Bad input from the user (a file, a flag, a name): shown as one line, never a traceback."""
