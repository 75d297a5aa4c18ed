"""Keras callbacks' file operations on N processes: rank 0 acts, all agree.

Under `torchrun` every process runs `fit` with the same callbacks and
arguments, so every rank runs Keras's own directory creation, copies and
deletes (`BackupAndRestore`, `ModelCheckpoint`, `CSVLogger`) on the same
shared paths. They race: `FileExistsError` from two `makedirs`,
`FileNotFoundError` from two `rmtree`, and one rank dies while the others
wait in a collective until the timeout.

Inside `fit`/`evaluate`/`predict` with several processes, Keras's
`file_utils` calls become collective decisions:

- queries (`exists`, `isdir`, `listdir`) are answered by rank 0, so every
  rank takes the same branch of the callback's code;
- changes (`makedirs`, `remove`, `rmtree`, `copy`) run on rank 0 only;
- `File` opened for writing is rank 0's file, a sink (`os.devnull`)
  elsewhere; for reading, every rank opens the file itself.

Each call ends with rank 0's outcome on every rank (a broadcast, bytes in a
tensor): if rank 0's operation failed, every rank raises the same error,
and nobody goes on before the change is on disk. `model.save*` inside a
callback is not affected: every rank runs it (`saving.py`). TensorBoard
writes its event files through TensorFlow, not `file_utils`: ranks other
than 0 write theirs to a private scratch directory (`wrap_tensorboard_
set_model`). Paths must be on a filesystem every rank sees, as with one
process and several readers.
"""

import atexit
import contextlib
import contextvars
import functools
import json
import os
import shutil
import tempfile

from keras_dtensor.backend import launch
from keras_dtensor.backend import object_state

__all__ = [
    "FILE_OPERATIONS",
    "active",
    "shared",
    "suspended",
    "wrap_file_operation",
    "wrap_tensorboard_set_model",
]

# The `keras.src.utils.file_utils` functions made collective.
FILE_OPERATIONS = (
    "exists",
    "isdir",
    "listdir",
    "makedirs",
    "remove",
    "rmtree",
    "copy",
    "File",
)

_ACTIVE = contextvars.ContextVar("keras_dtensor_shared_files", default=False)

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


@contextlib.contextmanager
def _scope(active):
    token = _ACTIVE.set(active)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def suspended():
    """A scope where `file_utils` calls are each rank's own again."""
    return _scope(False)


def shared():
    """The scope where `file_utils` calls are shared (`trainer_calls`)."""
    return _scope(True)


def active() -> bool:
    """Whether this thread is inside `shared()`."""
    return _ACTIVE.get()


def _path_text(filename):
    """An error's filename as JSON can carry it (bytes and path-likes as
    text), so rank 0 always reaches the broadcast."""
    if filename is None or isinstance(filename, (str, int)):
        return filename
    try:
        return os.fsdecode(filename)
    except TypeError:
        return str(filename)


def _on_rank_0(name, operation):
    """Runs `operation()` on rank 0; returns its JSON result on every rank."""
    _, rank = launch.world()
    payload = None
    if rank == 0:
        try:
            payload = {"result": operation()}
        except Exception as e:  # every rank raises it below
            payload = {
                "error": type(e).__name__,
                "errno": getattr(e, "errno", None),
                "strerror": getattr(e, "strerror", None),
                "filename": _path_text(getattr(e, "filename", None)),
                "message": str(e),
            }
        payload = json.dumps(payload).encode()
    outcome = json.loads(launch.broadcast_bytes(payload, src=0))
    if "error" not in outcome:
        return outcome["result"]
    cls = _ERRORS.get(outcome["error"], RuntimeError)
    where = (
        f" (file_utils.{name} on rank 0 of {launch.world()[0]}, on behalf "
        "of every rank)"
    )
    if issubclass(cls, OSError) and outcome["errno"] is not None:
        # OSError(errno, strerror, filename) prints "[Errno N] ...: 'f'".
        strerror = (outcome["strerror"] or outcome["message"]) + where
        if outcome["filename"] is None:
            raise cls(outcome["errno"], strerror)
        raise cls(outcome["errno"], strerror, outcome["filename"])
    raise cls(outcome["message"] + where)


def _writes(mode):
    return any(flag in mode for flag in "wax+")


def _sink_mode(mode):
    return mode.replace("x", "w").replace("+", "").replace("r", "w")


def wrap_file_operation(original, name):
    """Wraps `file_utils.<name>` (one of `FILE_OPERATIONS`)."""

    @functools.wraps(original)
    def operation(*args, **kwargs):
        if not _ACTIVE.get():
            return original(*args, **kwargs)
        if name == "File":
            mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
            if not _writes(mode):
                return original(*args, **kwargs)
            opened = []  # rank 0's file; its failure is raised everywhere
            _on_rank_0(name, lambda: opened.append(original(*args, **kwargs)))
            return opened[0] if opened else open(os.devnull, _sink_mode(mode))

        def run():
            result = original(*args, **kwargs)
            return result if name in ("exists", "isdir", "listdir") else None

        return _on_rank_0(name, run)

    return operation


def _scratch_dir(callback):
    scratch = object_state.get_on(callback, "_keras_dtensor_scratch")
    if scratch is None:
        scratch = tempfile.mkdtemp(prefix="keras_dtensor_tensorboard_")
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        object_state.set_on(callback, "_keras_dtensor_scratch", scratch)
    return scratch


def wrap_tensorboard_set_model(original):
    """Wraps `TensorBoard.set_model`: event files from rank 0 only.

    TensorBoard's writers and profiler take their directories from
    `log_dir` here; on other ranks that is a private scratch directory, so
    the shared log directory holds one run, not one per rank. Every rank
    still runs the callback (its weight histograms gather sharded weights,
    a collective).
    """

    @functools.wraps(original)
    def set_model(self, model):
        size, rank = launch.world()
        if size == 1 or rank == 0:
            return original(self, model)
        log_dir = self.log_dir
        self.log_dir = _scratch_dir(self)
        try:
            return original(self, model)
        finally:
            self.log_dir = log_dir

    return set_model
