"""Errors that psctl reports as one line, without a traceback."""


class UsageError(Exception):
    """The user asked for something that cannot work (bad flag value, missing file); exit code 2."""


class ConfigError(UsageError, ValueError):
    """A job file or an override is wrong; the message names the key and what is allowed."""


class JobFailed(Exception):
    """A job could not complete (a child it needs failed, a timeout ran out); exit code 1."""
