"""Keras's weight stores, fed sharded values without gathering them.

Inside a save's `h5_stream.scope()` (entered by `collective.py` on every
rank), the hooks here route each DTensor-backed value Keras stores to
`h5_stream.write`, which writes it in pieces from the ranks holding its
shards:

- `H5IOStore.__setitem__`: the layers' and the optimizer's variables
  (Keras converted each to numpy first: a whole gather on every rank);
- `BaseOptimizer.save_own_variables`: Keras stores `variable.numpy()`;
  here the store gets the variable;
- `ShardedH5IOStore.__setitem__` (`save_weights(..., max_shard_size=)`):
  Keras sizes its shard files from the numpy array; here the value passes
  through as a `Deferred` (shape and dtype only), which
  `convert_to_numpy` returns for a DTensor while `deferring()`.
"""

import contextvars
import functools

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor.saving import h5_stream

__all__ = [
    "Deferred",
    "deferring",
    "wrap_h5_store_setitem",
    "wrap_optimizer_save_own_variables",
    "wrap_sharded_h5_store_setitem",
]


def _dtensor_of(value):
    """The DTensor behind `value` (a variable, a tensor or a `Deferred`),
    or `None`."""
    from keras.src.backend.common.variables import Variable

    if isinstance(value, Variable):
        value = value.value
    elif isinstance(value, Deferred):
        value = value.dtensor
    return value if isinstance(value, DTensor) else None


class Deferred:
    """A sharded value on its way through Keras's `ShardedH5IOStore`: the
    store sizes its shard files from `shape` and `dtype` (as it would
    from the numpy array), then hands it to `H5IOStore.__setitem__`, which
    writes it in pieces. Made by `convert_to_numpy` inside
    `deferring()` only."""

    def __init__(self, dtensor):
        self.dtensor = dtensor
        self.shape = tuple(dtensor.shape)
        self.ndim = len(self.shape)
        self.dtype = h5_stream.numpy_dtype(dtensor.dtype)


_DEFER = contextvars.ContextVar("keras_dtensor_defer_numpy", default=False)


def deferring() -> bool:
    """Whether `convert_to_numpy` should return a `Deferred` for a DTensor
    (inside `ShardedH5IOStore.__setitem__` during a save) instead of
    gathering it."""
    return _DEFER.get()


def wrap_sharded_h5_store_setitem(original):
    """Wraps `ShardedH5IOStore.__setitem__(key, value)` (`save_weights`
    with `max_shard_size`): inside a save's `scope()`, a sharded value
    goes through Keras's shard-file bookkeeping as a `Deferred` and is
    written in pieces, never gathered."""

    @functools.wraps(original)
    def __setitem__(self, key, value):
        dtensor = _dtensor_of(value) if h5_stream.active() else None
        if dtensor is None or not h5_stream.streamable(dtensor):
            return original(self, key, value)
        token = _DEFER.set(True)
        try:
            return original(self, key, dtensor)
        finally:
            _DEFER.reset(token)

    return __setitem__


def wrap_h5_store_setitem(original):
    """Wraps `H5IOStore.__setitem__(key, value)`: inside a save's `scope()`
    a DTensor-backed value is written in pieces (see the module)."""

    @functools.wraps(original)
    def __setitem__(self, key, value):
        state = h5_stream.current()
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
    """Wraps `BaseOptimizer.save_own_variables(store)`: Keras stores
    `variable.numpy()`, a gather before the store sees it; inside a save's
    `scope()`, into an `H5IOStore`, each variable is stored itself (the
    store converts a plain one as `.numpy()` does, streams a sharded one).
    """

    @functools.wraps(original)
    def save_own_variables(self, store):
        from keras.src.saving import saving_lib

        streamed = isinstance(store, saving_lib.H5IOStore)
        if not h5_stream.active() or not streamed:
            return original(self, store)
        for i, variable in enumerate(self.variables):
            store[str(i)] = variable
        return None

    return save_own_variables
