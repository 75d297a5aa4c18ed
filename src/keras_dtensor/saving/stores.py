"""Keras's weight stores, fed sharded values without gathering them.

Inside a save, each DTensor-backed value goes to `h5_stream.write`; a
store opened for writing by hand (keras_hub's `save_lora_weights`) is a
`RankZeroFile`, put in place by its `close`.
"""

import contextvars
import functools
import os
import sys
import weakref

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor.backend import context
from keras_dtensor.backend import object_state
from keras_dtensor.backend.launch import multi_process
from keras_dtensor.saving import h5_stream
from keras_dtensor.saving.collective import RankZeroFile

__all__ = [
    "Deferred",
    "deferring",
    "wrap_h5_store_close",
    "wrap_h5_store_init",
    "wrap_h5_store_setitem",
    "wrap_optimizer_save_own_variables",
    "wrap_sharded_h5_store_setitem",
]


def _dtensor_of(value):
    """The DTensor behind a variable, tensor or `Deferred`, or `None`."""
    from keras.src.backend.common.variables import Variable

    if isinstance(value, Variable):
        value = value.value
    elif isinstance(value, Deferred):
        value = value.dtensor
    return value if isinstance(value, DTensor) else None


class Deferred:
    """A sharded value's `shape` and `dtype`, all `ShardedH5IOStore` needs
    (what `convert_to_numpy` returns inside `deferring()`)."""

    def __init__(self, dtensor):
        self.dtensor = dtensor
        self.shape = tuple(dtensor.shape)
        self.ndim = len(self.shape)
        self.dtype = h5_stream.numpy_dtype(dtensor.dtype)


_DEFER = contextvars.ContextVar("keras_dtensor_defer_numpy", default=False)


def deferring() -> bool:
    """Whether `convert_to_numpy` returns a `Deferred` for a DTensor."""
    return _DEFER.get()


def wrap_sharded_h5_store_setitem(original):
    """Wraps `ShardedH5IOStore.__setitem__`: a sharded value passes as a
    `Deferred` inside a save."""

    @functools.wraps(original)
    def __setitem__(self, key, value):
        active = h5_stream.current() is not None
        dtensor = _dtensor_of(value) if active else None
        if dtensor is None or not h5_stream.streamable(dtensor):
            return original(self, key, value)
        with context.scoped(_DEFER, True):
            return original(self, key, dtensor)

    return __setitem__


def wrap_h5_store_setitem(original):
    """Wraps `H5IOStore.__setitem__`: `h5_stream.write` inside a save."""

    @functools.wraps(original)
    def __setitem__(self, key, value):
        direct = object_state.get_on(self, _DIRECT)
        state = h5_stream.current() if direct is None else direct[1]
        if state is None or self.mode not in ("w", "a"):
            return original(self, key, value)
        dtensor = _dtensor_of(value)
        if dtensor is not None and h5_stream.streamable(dtensor):
            with torch.no_grad():
                h5_stream.write(self, key, dtensor, state)
            return None
        if state.error is not None:
            if dtensor is not None:  # its gather is a collective: take part
                dtensor.full_tensor()
            return None
        try:
            return original(self, key, value)
        except Exception as e:
            state.error = e
            return None

    return __setitem__


def wrap_optimizer_save_own_variables(original):
    """Wraps `BaseOptimizer.save_own_variables`: inside a save, an
    `H5IOStore` gets each variable, not its `.numpy()`."""

    @functools.wraps(original)
    def save_own_variables(self, store):
        from keras.src.saving import saving_lib

        streamed = isinstance(store, saving_lib.H5IOStore)
        if h5_stream.current() is None or not streamed:
            return original(self, store)
        for i, variable in enumerate(self.variables):
            store[str(i)] = variable
        return None

    return save_own_variables


# On a store opened by `wrap_h5_store_init`: `(RankZeroFile, stream state)`.
_DIRECT = "_keras_dtensor_direct_write"


def wrap_h5_store_init(original):
    """Wraps `H5IOStore.__init__`: a file opened for writing outside a
    save, under a distribution, is a `RankZeroFile`."""

    @functools.wraps(original)
    def __init__(self, path_or_io, archive=None, mode="r"):
        if (
            mode != "w"
            or archive is not None
            or not isinstance(path_or_io, (str, os.PathLike))
            or h5_stream.current() is not None
            or not multi_process()
            or context.current() is None
        ):
            return original(self, path_or_io, archive, mode)
        caller = sys._getframe(1).f_code.co_name
        written = RankZeroFile(caller, path_or_io)
        problem = None
        try:
            original(self, written.target, archive, mode)
        except Exception as e:
            problem = e
        written.check(problem)  # raises on every rank if any failed
        state = h5_stream.new_save()
        object_state.set_on(self, _DIRECT, (written, state))
        # A writer that raises before `close()` leaves nothing behind.
        weakref.finalize(self, written.discard)
        weakref.finalize(self, h5_stream.end_save, state)
        return None

    return __init__


def wrap_h5_store_close(original):
    """Wraps `H5IOStore.close()`: finishes a `wrap_h5_store_init` file."""

    @functools.wraps(original)
    def close(self):
        direct = object_state.get_on(self, _DIRECT)
        if direct is None:
            return original(self)
        object_state.set_on(self, _DIRECT, None)
        written, state = direct
        problem = None
        try:
            original(self)
        except Exception as e:
            problem = e
        h5_stream.end_save(state)
        written.finish(state.error or problem)
        return None

    return close
