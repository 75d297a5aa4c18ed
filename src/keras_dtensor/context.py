"""What every hook asks first: which distribution runs, and in what scope.

- `current()`: the active `keras.distribution.Distribution` (Keras keeps
  it, `set_distribution`/`Distribution.scope()` set it), or `None`.
- `is_data_parallel()`: whether it is `DataParallel`, which runs the DDP
  way on plain tensors (see `keras_dtensor.data_parallel`) instead of on
  DTensors.
- `global_values()`: the scope in which a plain tensor meeting a DTensor
  counts as replicated.

Nothing here communicates or keeps state of its own: the scope's depth is
a context variable.
"""

import contextlib
import contextvars
import functools

__all__ = ["current", "global_values", "is_data_parallel"]

_GLOBAL_DEPTH = contextvars.ContextVar("keras_dtensor_global_depth", default=0)


def current():
    """The active Keras distribution, or `None`.

    Example:
    >>> with keras.distribution.DataParallel().scope():
    ...     context.current()
    <DataParallel ...>
    """
    from keras.distribution import distribution

    return distribution()


@functools.cache
def _data_parallel_class():
    from keras.distribution import DataParallel

    return DataParallel


def is_data_parallel(distribution=None) -> bool:
    """Whether `distribution` (default: the current one) is `DataParallel`.

    Called on every layer call under a distribution: the class lookup is
    done once.
    """
    if distribution is None:
        distribution = current()
    return isinstance(distribution, _data_parallel_class())


@contextlib.contextmanager
def global_values():
    """Inside: a plain tensor meeting a DTensor counts as replicated.

    Keras programs are single-program: a tensor that a layer, loss,
    initializer or seed generator creates (`ops.ones`, a dropout mask drawn
    from an agreed seed, a seed increment) holds the same global value on
    every process, so it *is* replicated. Data is the exception (a rank's
    slice is not the global value), and every data path becomes DTensors
    before entering here (`data.distribute_batch`), so no rank-local tensor
    is mistaken for a global one. Outside these scopes (user code between
    steps) a plain tensor meeting a DTensor still raises torch's "mixed
    torch.Tensor and DTensor" error. Re-entrant, unlike torch's
    `implicit_replication`, which it enters once.
    """
    from torch.distributed.tensor.experimental import implicit_replication

    depth = _GLOBAL_DEPTH.get()
    token = _GLOBAL_DEPTH.set(depth + 1)
    try:
        with implicit_replication() if depth == 0 else contextlib.nullcontext():
            yield
    finally:
        _GLOBAL_DEPTH.reset(token)
