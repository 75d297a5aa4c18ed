"""One outcome on every rank: failures shared, rank 0's answer broadcast.

A step that fails on one rank while the others go on to the next
collective leaves them waiting until the process group's timeout. The
steps that can fail on some ranks only (a file rank 0 cannot create, a
write that fails on one rank) end here instead, and every rank raises:

- `failures` gathers every rank's failure message (an all-gather);
  `first_failure` keeps the lowest rank's;
- `on_rank_0` runs an operation on rank 0 alone and hands its result (or
  its error, rebuilt with its type) to every rank (a broadcast);
- `files_shared()` is the scope in which Keras's file operations are
  such decisions (`hooks/shared_files.py`, inside `fit`), and
  `files_shared(False)` the one in which each rank's are its own again
  (a save, where every rank runs Keras's writer on its own target).

Messages travel as bytes in tensors (`launch`): nothing from a peer is
unpickled. Without a group of several processes each is the rank's own.

Example:
>>> problem = None
>>> try:
...     os.makedirs(path)
... except OSError as e:
...     problem = e
>>> problem = consensus.first_failure(problem)  # the same on every rank
"""

import contextlib
import contextvars
import json
import os

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
    """Every rank's failure, on every rank (a collective).

    Args:
        problem: this rank's failure (an error, sent as `str(problem)`, or
            a message), or `None` if it has none.

    Returns:
        `[(rank, message), ...]` of the ranks that failed, by rank.
    """
    mine = "" if problem is None else str(problem)
    gathered = launch.all_gather_bytes(mine.encode())
    return [(r, m.decode()) for r, m in enumerate(gathered) if m]


def first_failure(problem: BaseException | str | None) -> str | None:
    """The lowest failing rank's message on every rank, or `None` (a
    collective; see `failures`)."""
    found = failures(problem)
    return found[0][1] if found else None


def _path_text(filename):
    """An error's filename as JSON can carry it (bytes and path-likes as
    text), so rank 0 always reaches the broadcast."""
    if filename is None or isinstance(filename, (str, int)):
        return filename
    try:
        return os.fsdecode(filename)
    except TypeError:
        return str(filename)


def _error_fields(error):
    return {
        "error": type(error).__name__,
        "errno": getattr(error, "errno", None),
        "strerror": getattr(error, "strerror", None),
        "filename": _path_text(getattr(error, "filename", None)),
        "message": str(error),
    }


def _rebuilt(outcome, where):
    """Rank 0's error, its type kept where it is a known one (else a
    `RuntimeError`), `where` appended to its message."""
    cls = _ERRORS.get(outcome["error"], RuntimeError)
    if issubclass(cls, OSError) and outcome["errno"] is not None:
        # OSError(errno, strerror, filename) prints "[Errno N] ...: 'f'".
        strerror = (outcome["strerror"] or outcome["message"]) + where
        if outcome["filename"] is None:
            return cls(outcome["errno"], strerror)
        return cls(outcome["errno"], strerror, outcome["filename"])
    return cls(outcome["message"] + where)


def on_rank_0(operation, what):
    """Runs `operation()` on rank 0; its result on every rank (a
    collective).

    If it raises, every rank raises the same error, its type kept for
    file-system errors and `ValueError`, saying it happened on rank 0 on
    behalf of every rank.

    Args:
        operation: a callable returning something JSON can carry.
        what: the operation's name, for the error message.

    Returns:
        Rank 0's result.
    """
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
    where = f" ({what} on rank 0 of {size}, on behalf of every rank)"
    raise _rebuilt(outcome, where)


@contextlib.contextmanager
def files_shared(shared: bool = True):
    """The scope in which Keras's file operations are decided on rank 0
    for every rank (`shared`), or are each rank's own (not `shared`)."""
    token = _FILES_SHARED.set(shared)
    try:
        yield
    finally:
        _FILES_SHARED.reset(token)


def files_are_shared() -> bool:
    """Whether this thread is inside `files_shared()`."""
    return _FILES_SHARED.get()
