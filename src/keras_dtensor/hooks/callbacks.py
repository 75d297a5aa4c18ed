"""Callbacks and console output in a multi-process run.

1. Keras runs batch-end callbacks on a thread pool when the backend says
   it is thread-safe. Those callbacks convert the batch's logs (and
   `predict`'s outputs) to numpy: for a DTensor that is a collective, and a
   collective issued from a worker thread interleaves with the main
   thread's collectives in a different order on each rank (seen as
   "Received data size doesn't match expected size" in `predict`). With
   several processes, callbacks are dispatched synchronously.

2. Every Keras message goes through `keras.src.utils.io_utils.print_msg`;
   with several processes the other ranks' copies are dropped, since logged
   values are global and identical on every rank. `model.summary()` prints
   through a console of its own: it too prints from rank 0 only (a
   `print_fn` of the caller's runs on every rank). Set
   `KERAS_DTENSOR_LOG_ALL_RANKS=1` to print on every rank.
"""

from keras_dtensor.backend import console
from keras_dtensor.backend.launch import multi_process

__all__ = [
    "wrap_configure_async_dispatch",
    "wrap_print_msg",
    "wrap_print_summary",
]


def wrap_configure_async_dispatch(original):
    """Wraps `CallbackList._configure_async_dispatch` (see 1. above)."""

    def _configure_async_dispatch(self, callbacks):
        original(self, callbacks)
        if multi_process():
            self._async_train = False
            self._async_test = False
            self._async_predict = False

    return _configure_async_dispatch


def wrap_print_msg(original):
    """Wraps `io_utils.print_msg`: a no-op on ranks other than 0."""

    def _print_msg(message, line_break=True):
        if console.silent():
            return None
        return original(message, line_break=line_break)

    return _print_msg


def wrap_print_summary(original):
    """Wraps `summary_utils.print_summary`: printed from rank 0 only unless
    the caller passes its own `print_fn` (see 2. above)."""

    def print_summary(model, *args, **kwargs):
        if (
            kwargs.get("print_fn") is None
            and len(args) < 3
            and console.silent()
        ):
            return None
        return original(model, *args, **kwargs)

    return print_summary
