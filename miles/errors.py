"""User-facing errors: the CLI prints their message (no traceback) and exits with status 2."""


class MilesUserError(Exception):
    """Bad input from the user (config, paths, data): the message says what to do."""
