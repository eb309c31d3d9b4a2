"""Errors that the CLI reports as one clear line with exit code 2 (no traceback)."""


class UserError(Exception):
    """Bad input from the user: a config key, a value, a preset name, a prompt file, missing weights."""

    #: the CLI's exit code (a subclass that is not bad input may say otherwise)
    exit_code = 2


class ConfigError(UserError):
    """An invalid configuration key or value."""


class RewardUnavailableError(UserError):
    """A reward service (the ``remote`` reward's server) did not answer within its retries: the run
    stops with one line naming the URL; its last checkpoint is intact and ``--resume`` continues."""


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """The first line of ``exc``'s message (empty for none), cut to ``limit`` characters with "..."."""
    text = (str(exc).strip().splitlines() or [""])[0]
    return text if limit is None or len(text) <= limit else text[:limit] + "..."
