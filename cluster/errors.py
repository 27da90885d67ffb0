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


def out_of_memory(exc: BaseException) -> str | None:
    """One line for a GPU that ran out of memory anywhere in ``exc``'s chain (CuPy's or PyTorch's error), else None.

    Matched by name, so that saying it imports neither library: CuPy's ``cupy.cuda.memory.OutOfMemoryError``
    (its memory pool), its ``CUDARuntimeError`` of ``cudaErrorMemoryAllocation`` (a page-locked host
    buffer, an IPC slot), PyTorch's ``torch.OutOfMemoryError``.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        kind, module = type(exc).__name__, type(exc).__module__ or ""
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else kind
        if (kind == "OutOfMemoryError" and module.startswith(("cupy", "torch"))) or (
            kind == "CUDARuntimeError" and "cudaErrorMemoryAllocation" in text
        ):
            return (
                f"out of GPU memory ({text}): lower [train] batch_size, run fewer workers on each GPU, "
                f'or keep the shards in host memory ([server] shard_device = "cpu")'
            )
        exc = exc.__cause__ or exc.__context__
    return None
