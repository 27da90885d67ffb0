"""Errors that psctl reports as one line, without a traceback."""


class UsageError(Exception):
    """The user asked for something that cannot work (bad flag value, missing file); exit code 2."""


class ConfigError(UsageError, ValueError):
    """A job file or an override is wrong; the message names the key and what is allowed."""


class JobFailed(Exception):
    """A job could not complete (a child it needs failed, a timeout ran out); exit code 1.

    ``status`` is the summary's: ``failed``, or a word for a mistake that would otherwise look
    like success (``not_joined``: the user's command never called ``psgrid.init``).
    """

    def __init__(self, message: str, status: str = "failed"):
        super().__init__(message)
        self.status = status
