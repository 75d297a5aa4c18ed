"""What every hook asks first: which distribution runs, and in what scope.

- `current()`: the active `keras.distribution.Distribution` (Keras keeps
  it, `set_distribution`/`Distribution.scope()` set it), or `None`.
- `active()`: the same, but only when it spans several processes: over
  one process a distribution computes what plain Keras computes, on plain
  tensors, so every hook that asks `active()` returns at once.
- `is_data_parallel()`: whether it is `DataParallel`, which runs the DDP
  way on plain tensors (see `keras_dtensor.data_parallel`) instead of on
  DTensors.
- `global_values()`: the scope in which a plain tensor meeting a DTensor
  counts as replicated; `wrap_set_distribution` extends it to all code
  while a distribution other than `DataParallel` is set (and quiets
  torch's warning about it there).

Nothing here communicates or keeps state of its own: the scope is DTensor's
own (thread-local) implicit-replication setting.
"""

import contextlib
import functools
import re
import warnings

from keras_dtensor.backend.distribution_lib import device_ranks
from keras_dtensor.backend.launch import multi_process

__all__ = [
    "active",
    "current",
    "global_values",
    "is_data_parallel",
    "set_global_values",
    "wrap_set_distribution",
]


_GETTER = []


def _distribution_getter():
    # Resolved once into a plain list: an import statement in a hook costs
    # every layer call, and torch.compile traces a list lookup where it
    # only warns about a cached function.
    if not _GETTER:
        from keras.distribution import distribution

        _GETTER.append(distribution)
    return _GETTER[0]


def current():
    """The active Keras distribution, or `None`.

    Called by every hook first, on every layer call: one lookup, which
    `torch.compile` traces (no graph break in a compiled step).

    Example:
    >>> with keras.distribution.DataParallel().scope():
    ...     context.current()
    <DataParallel ...>
    """
    return _distribution_getter()()


def active():
    """The current distribution if it spans several processes, else `None`.

    A job of one process (plain `python`, or `torchrun` with one process)
    under `ModelParallel` or `DataParallel` has a one-device mesh: every
    layout is replication, so it runs as plain Keras (plain tensors, Keras's
    own step and compile) and costs what plain Keras costs. Layouts are
    still checked when variables are created (see `variables.py`), so a
    layout error shows at one process too. Keras decides once, when the
    distribution is built (`Distribution._is_multi_process`, from the
    backend's `num_processes()`).

    Example:
    >>> with keras.distribution.DataParallel().scope():  # plain python
    ...     context.active()
    None
    """
    distribution = current()
    if distribution is None or not getattr(
        distribution, "_is_multi_process", True
    ):
        return None
    return distribution


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
    before entering here (`batch_layout.distribute_batch`), so no
    rank-local tensor is mistaken for a global one. Outside these scopes
    (user code between steps) under `DataParallel` or no distribution a
    plain tensor meeting a DTensor still raises torch's "mixed
    torch.Tensor and DTensor" error.
    Re-entrant: it restores the setting it found (torch's
    `implicit_replication` resets it to off).
    """
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    before = dispatcher._allow_implicit_replication
    dispatcher._allow_implicit_replication = True
    try:
        yield
    finally:
        dispatcher._allow_implicit_replication = before


# torch warns, on every rank and also where implicit replication is on,
# each time it replicates a one-element 1-d plain tensor that meets a
# DTensor (keras_hub's cache index in `generate`); while plain tensors are
# global values that is the rule, not an accident. The entry
# `warnings.filterwarnings` makes for it, as documented for
# `warnings.filters`.
_ONE_ELEMENT = (
    "ignore",
    re.compile("Found a non-scalar tensor with numel=1 and ndim!=0", re.I),
    UserWarning,
    None,
    0,
)


def set_global_values(distribution):
    """Plain tensors count as global values under `distribution`, if it
    is not `None` or `DataParallel`; torch's warning about one-element
    tensors is quiet while they do."""
    from torch.distributed.tensor import DTensor

    on = distribution is not None and not is_data_parallel(distribution)
    DTensor._op_dispatcher._allow_implicit_replication = on
    present = _ONE_ELEMENT in warnings.filters
    if on and not present:
        # Only when missing: every change of the filters resets every
        # module's record of the warnings it already showed.
        _, message, category, _, _ = _ONE_ELEMENT
        warnings.filterwarnings("ignore", message.pattern, category)
    elif present and not on:
        warnings.filters.remove(_ONE_ELEMENT)


def wrap_set_distribution(original):
    """Wraps `keras.distribution.set_distribution` (which `scope()` calls).

    While a distribution other than `DataParallel` is set, every plain
    tensor is a global value, as every plain array is on JAX: data enters
    as DTensors (`batch_layout.distribute_batch`), so a plain tensor that
    meets a DTensor anywhere (a sampler's prompt and index in keras_hub's
    `generate`, a mask built between calls) holds the same value on every
    process and counts as replicated. Setting or clearing the distribution
    sets DTensor's implicit replication on or off (it is thread-local, like
    Keras's current distribution).
    """

    def set_distribution(value):
        if value is not None and is_data_parallel(value) and multi_process():
            # DataParallel never builds its mesh on torch: check it here,
            # or `DataParallel(devices=...)` of the wrong length is ignored.
            device_ranks(value.device_mesh)
        original(value)
        set_global_values(value)

    return set_distribution
