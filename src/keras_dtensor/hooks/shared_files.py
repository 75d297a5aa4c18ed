"""Callbacks' file operations: rank 0 acts, every rank gets its outcome."""

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
    "wrap_file_operation",
    "wrap_tensorboard_set_model",
]

# The `keras.src.utils.file_utils` functions made collective.
_QUERIES = ("exists", "isdir", "listdir")
FILE_OPERATIONS = (*_QUERIES, "makedirs", "remove", "rmtree", "copy", "File")


def wrap_file_operation(original, name):
    """Wraps `file_utils.<name>` (one of `FILE_OPERATIONS`)."""

    @functools.wraps(original)
    def operation(*args, **kwargs):
        if not consensus.files_are_shared():
            return original(*args, **kwargs)
        if name == "File":
            mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
            if not any(flag in mode for flag in "wax+"):
                return original(*args, **kwargs)
            opened = []  # rank 0's file; its failure is raised everywhere
            consensus.on_rank_0(
                lambda: opened.append(original(*args, **kwargs)),
                f"file_utils.{name}",
            )
            if opened:
                return opened[0]
            sink = mode.replace("x", "w").replace("+", "").replace("r", "w")
            return open(os.devnull, sink)

        def run():
            result = original(*args, **kwargs)
            return result if name in _QUERIES else None

        return consensus.on_rank_0(run, f"file_utils.{name}")

    return operation


def wrap_tensorboard_set_model(original):
    """Wraps `TensorBoard.set_model`: other ranks log to a scratch dir."""

    @functools.wraps(original)
    def set_model(self, model):
        size, rank = launch.world()
        if size == 1 or rank == 0:
            return original(self, model)
        scratch = object_state.get_on(self, "_keras_dtensor_scratch")
        if scratch is None:
            scratch = tempfile.mkdtemp(prefix="keras_dtensor_tensorboard_")
            atexit.register(shutil.rmtree, scratch, ignore_errors=True)
            object_state.set_on(self, "_keras_dtensor_scratch", scratch)
        with object_state.swapped(self, "log_dir", scratch):
            return original(self, model)

    return set_model
