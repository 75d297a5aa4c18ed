"""Seeded random draws under DataParallel: this rank's rows of the global draw.

In a train step a seeded draw shaped like this rank's rows is drawn for the
global batch and cut to its rows: the values one process would use.
Unseeded draws (torch's global generator) are left alone.
"""

import collections
import contextlib
import contextvars
import functools

import torch

from keras_dtensor.backend import context
from keras_dtensor.data_parallel.batch_split import row_range

__all__ = [
    "SHAPED_DRAWS",
    "split_rows",
    "wrap_dropout",
    "wrap_shaped_draw",
]

# `keras.src.backend.torch.random` functions whose first argument is a shape.
SHAPED_DRAWS = (
    "normal",
    "uniform",
    "randint",
    "truncated_normal",
    "gamma",
    "binomial",
    "beta",
)


_Rows = collections.namedtuple("_Rows", ["start", "length", "total"])

_ROWS = contextvars.ContextVar("keras_dtensor_random_rows", default=None)


@contextlib.contextmanager
def split_rows(rows, total):
    """A train step on this rank's `rows` of a global batch of `total`
    (`None`: unknown, draws left alone)."""
    split = None
    if total is not None and rows != total:
        split = _Rows(row_range(total)[0], rows, total)
    token = _ROWS.set(split)
    try:
        yield
    finally:
        _ROWS.reset(token)


def _seeded(seed):
    from keras.src.random.seed_generator import SeedGenerator

    if seed is None:
        return False
    return not (isinstance(seed, SeedGenerator) and seed._initial_seed is None)


def _rows_for(shape, seed):
    rows = _ROWS.get()
    if rows is None or not _seeded(seed) or not shape:
        return None
    return rows if shape[0] == rows.length else None


def wrap_shaped_draw(original):
    """Wraps `random.<draw>(shape, ..., seed=None)` (see above)."""

    @functools.wraps(original)
    def draw(shape, *args, **kwargs):
        # Nothing distributed: return before the ContextVar read, which
        # torch.compile cannot trace (a graph break in every compiled step).
        if context.current() is None or _ROWS.get() is None:
            return original(shape, *args, **kwargs)
        rows = _rows_for(tuple(shape), kwargs.get("seed"))
        if rows is None:
            return original(shape, *args, **kwargs)
        whole = original((rows.total, *tuple(shape)[1:]), *args, **kwargs)
        return whole[rows.start : rows.start + rows.length]

    return draw


def wrap_dropout(original):
    """Wraps `random.dropout(inputs, rate, noise_shape=None, seed=None)`."""

    @functools.wraps(original)
    def dropout(inputs, rate, noise_shape=None, seed=None):
        if (
            context.current() is None  # as in draw()
            or _ROWS.get() is None
            or rate in (0.0, 1.0)
            or not _seeded(seed)
        ):
            return original(inputs, rate, noise_shape, seed)
        shape = tuple(inputs.shape)
        if noise_shape is not None:
            shape = tuple(
                n if d is None else d
                for n, d in zip(shape, noise_shape, strict=True)
            )
        rows = _rows_for(shape, seed)
        if rows is None or inputs.device.type == "meta":
            return original(inputs, rate, noise_shape, seed)
        # The global mask as one process draws it, cut to this rank's rows.
        from keras.src.backend.torch.random import torch_seed_generator

        keep_prob = 1.0 - rate
        whole = torch.full(
            (rows.total, *shape[1:]), keep_prob, device=inputs.device
        )
        mask = torch.bernoulli(whole, generator=torch_seed_generator(seed))
        mask = mask[rows.start : rows.start + rows.length].bool()
        return torch.where(
            torch.broadcast_to(mask, inputs.shape),
            inputs / keep_prob,
            torch.zeros_like(inputs, dtype=inputs.dtype),
        )

    return dropout
