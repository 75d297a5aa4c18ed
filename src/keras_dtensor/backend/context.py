"""Which distribution runs (`active()`: one over several processes), and
plain tensors as replicated values (DTensor's implicit replication).
"""

import contextlib
import functools
import re
import warnings

from torch.distributed.tensor import DTensor

from keras_dtensor.backend.distribution_lib import device_ranks
from keras_dtensor.backend.launch import multi_process

__all__ = [
    "active",
    "current",
    "global_values",
    "is_data_parallel",
    "scoped",
    "set_global_values",
    "wrap_set_distribution",
]


@contextlib.contextmanager
def scoped(var, value):
    """A context in which context variable `var` holds `value`."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


_GETTER = []  # not functools.cache: torch.compile traces a list lookup


def current():
    """The active Keras distribution, or `None` (traced by `torch.compile`)."""
    if not _GETTER:
        from keras.distribution import distribution

        _GETTER.append(distribution)
    return _GETTER[0]()


def active():
    """The current distribution if it spans several processes, else `None`."""
    distribution = current()
    several = getattr(distribution, "_is_multi_process", True)
    return distribution if several else None  # `None` stays `None`


@functools.cache
def _data_parallel_class():
    from keras.distribution import DataParallel

    return DataParallel


def is_data_parallel(distribution=None) -> bool:
    """Whether `distribution` (default: the current one) is `DataParallel`."""
    if distribution is None:
        distribution = current()
    return isinstance(distribution, _data_parallel_class())


@contextlib.contextmanager
def global_values(allowed=True):
    """Re-entrant `implicit_replication`: plain tensors count as replicated
    (`allowed=False`: a DTensor meeting a plain tensor raises)."""
    dispatcher = DTensor._op_dispatcher
    before = dispatcher._allow_implicit_replication
    dispatcher._allow_implicit_replication = allowed
    try:
        yield
    finally:
        dispatcher._allow_implicit_replication = before


# Quiets torch's warning when it replicates a one-element plain tensor.
_ONE_ELEMENT = (
    "ignore",
    re.compile("Found a non-scalar tensor with numel=1 and ndim!=0", re.I),
    UserWarning,
    None,
    0,
)


def set_global_values(distribution):
    """Plain tensors are global values under a distribution but DataParallel."""
    on = distribution is not None and not is_data_parallel(distribution)
    DTensor._op_dispatcher._allow_implicit_replication = on
    present = _ONE_ELEMENT in warnings.filters
    if on and not present:
        # Only when missing: a change resets every "already shown" record.
        _, message, category, _, _ = _ONE_ELEMENT
        warnings.filterwarnings("ignore", message.pattern, category)
    elif present and not on:
        warnings.filters.remove(_ONE_ELEMENT)


def wrap_set_distribution(original):
    """Wraps `keras.distribution.set_distribution` to `set_global_values`."""

    def set_distribution(value):
        if value is not None and is_data_parallel(value) and multi_process():
            device_ranks(value.device_mesh)  # DataParallel never builds it
        original(value)
        set_global_values(value)

    return set_distribution
