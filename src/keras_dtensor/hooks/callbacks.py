"""Callbacks run synchronously on N processes; rank 0 alone prints."""

from keras_dtensor.backend import console
from keras_dtensor.backend.launch import multi_process

__all__ = [
    "wrap_configure_async_dispatch",
    "wrap_print_msg",
    "wrap_print_summary",
]


def wrap_configure_async_dispatch(original):
    """Wraps `CallbackList._configure_async_dispatch`: synchronous."""

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
        if not console.silent():
            return original(message, line_break=line_break)

    return _print_msg


def wrap_print_summary(original):
    """Wraps `summary_utils.print_summary`: rank 0 only, bar a `print_fn`."""

    def print_summary(model, *args, **kwargs):
        if (
            kwargs.get("print_fn") is None
            and len(args) < 3
            and console.silent()
        ):
            return None
        return original(model, *args, **kwargs)

    return print_summary
