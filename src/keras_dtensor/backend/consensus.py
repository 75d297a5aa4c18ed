"""One outcome on every rank: failures shared, rank 0's answer broadcast,
so no rank waits at a collective the others left. Messages travel as
bytes in tensors: nothing from a peer is unpickled.
"""

import contextlib
import contextvars
import json
import os

from keras_dtensor.backend import context
from keras_dtensor.backend import launch

__all__ = [
    "failures",
    "files_are_shared",
    "files_shared",
    "first_failure",
    "on_rank_0",
]

_FILES_SHARED = contextvars.ContextVar(
    "keras_dtensor_shared_files", default=False
)

# Errors rebuilt with their own type on the ranks that did not run the call.
_ERRORS = {
    cls.__name__: cls
    for cls in (
        FileExistsError,
        FileNotFoundError,
        IsADirectoryError,
        NotADirectoryError,
        PermissionError,
        OSError,
        ValueError,
    )
}


def failures(problem: BaseException | str | None) -> list[tuple[int, str]]:
    """`[(rank, message)]` of the ranks with a `problem` (an all-gather)."""
    mine = "" if problem is None else str(problem)
    gathered = launch.all_gather_bytes(mine.encode())
    return [(r, m.decode()) for r, m in enumerate(gathered) if m]


def first_failure(problem: BaseException | str | None) -> str | None:
    """The lowest failing rank's message on every rank, or `None`."""
    found = failures(problem)
    return found[0][1] if found else None


def _error_fields(error):
    filename = getattr(error, "filename", None)
    if not isinstance(filename, (str, int, type(None))):
        try:
            filename = os.fsdecode(filename)
        except TypeError:
            filename = str(filename)
    return {
        "error": type(error).__name__,
        "errno": getattr(error, "errno", None),
        "strerror": getattr(error, "strerror", None),
        "filename": filename,
        "message": str(error),
    }


def on_rank_0(operation, what):
    """Rank 0's `operation()` (JSON), or its error naming `what`, everywhere."""
    size, rank = launch.world()
    payload = None
    if rank == 0:
        try:
            outcome = {"result": operation()}
        except Exception as e:  # every rank raises it below
            outcome = _error_fields(e)
        payload = json.dumps(outcome).encode()
    outcome = json.loads(launch.broadcast_bytes(payload, src=0))
    if "error" not in outcome:
        return outcome["result"]
    # Rank 0's error, its type kept if known.
    where = f" ({what} on rank 0 of {size}, on behalf of every rank)"
    cls = _ERRORS.get(outcome["error"], RuntimeError)
    if issubclass(cls, OSError) and outcome["errno"] is not None:
        # OSError(errno, strerror, filename) prints "[Errno N] ...: 'f'".
        strerror = (outcome["strerror"] or outcome["message"]) + where
        filename = [] if outcome["filename"] is None else [outcome["filename"]]
        raise cls(outcome["errno"], strerror, *filename)
    raise cls(outcome["message"] + where)


@contextlib.contextmanager
def files_shared(shared: bool = True):
    """Keras's file operations decided on rank 0 (`shared`) or per rank."""
    with context.scoped(_FILES_SHARED, shared):
        yield


def files_are_shared() -> bool:
    """Whether this thread is inside `files_shared()`."""
    return _FILES_SHARED.get()
