"""``(did you mean 'sync'?)``: a value a job file or flag got wrong, followed by the choice it was closest to."""

from __future__ import annotations

import difflib
import re

# The field's other names for a mode: BSP and ASP are what the literature calls sync and async.
MODE_SYNONYMS = {"bsp": "sync", "asp": "async", "synchronous": "sync", "asynchronous": "async"}


def with_suggestion(message: str) -> str:
    """A value error with ``(did you mean 'async'?)`` added where the value is close to one of the choices."""
    found = re.search(r"must be one of \(([^)]*)\), got '([^']*)'", message)
    if not found:
        return message
    choices = re.findall(r"'([^']*)'", found[1])
    synonym = MODE_SYNONYMS.get(found[2].lower())
    if synonym in choices:
        return f"{message} (did you mean {synonym!r}?)"
    close = difflib.get_close_matches(found[2], choices, n=1)
    return f"{message} (did you mean {close[0]!r}?)" if close else message
