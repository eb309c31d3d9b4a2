"""Errors that the CLI reports as one clear line with exit code 2 (no traceback)."""


class UserError(Exception):
    """Bad input from the user: a config key, a value, a preset name, a prompt file, missing weights."""


class ConfigError(UserError):
    """An invalid configuration key or value."""
