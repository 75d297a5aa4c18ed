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

Each call ends with rank 0's outcome on every rank (`consensus.on_rank_0`):
if rank 0's operation failed, every rank raises the same error, and nobody
goes on before the change is on disk. `model.save*` inside a callback is
not affected: every rank runs it (`saving/collective.py`). TensorBoard
writes its event files through TensorFlow, not `file_utils`: ranks other
than 0 write theirs to a private scratch directory (`wrap_tensorboard_
set_model`). Paths must be on a filesystem every rank sees, as with one
process and several readers.
"""

import atexit
import functools
import os
import shutil
import tempfile

from keras_dtensor.backend import consensus
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


def suspended():
    """A scope where `file_utils` calls are each rank's own again."""
    return consensus.files_shared(False)


def shared():
    """The scope where `file_utils` calls are shared (`hooks/fit_guard.py`)."""
    return consensus.files_shared(True)


def active() -> bool:
    """Whether this thread is inside `shared()`."""
    return consensus.files_are_shared()


def _writes(mode):
    return any(flag in mode for flag in "wax+")


def _sink_mode(mode):
    return mode.replace("x", "w").replace("+", "").replace("r", "w")


def wrap_file_operation(original, name):
    """Wraps `file_utils.<name>` (one of `FILE_OPERATIONS`)."""

    @functools.wraps(original)
    def operation(*args, **kwargs):
        if not consensus.files_are_shared():
            return original(*args, **kwargs)
        if name == "File":
            mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
            if not _writes(mode):
                return original(*args, **kwargs)
            opened = []  # rank 0's file; its failure is raised everywhere
            consensus.on_rank_0(
                lambda: opened.append(original(*args, **kwargs)),
                f"file_utils.{name}",
            )
            return opened[0] if opened else open(os.devnull, _sink_mode(mode))

        def run():
            result = original(*args, **kwargs)
            return result if name in ("exists", "isdir", "listdir") else None

        return consensus.on_rank_0(run, f"file_utils.{name}")

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
