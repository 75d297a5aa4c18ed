"""A batch split into balanced per-rank rows, and gathered back.

A seeded draw shaped like this rank's rows is drawn for the global batch
and cut to its rows, as one process would draw it; unseeded ones are not.
"""

import contextlib
import contextvars
import functools

import torch
import torch.distributed as dist

from keras_dtensor import compat
from keras_dtensor.backend import context
from keras_dtensor.backend.launch import all_gather_ints
from keras_dtensor.backend.launch import world

__all__ = [
    "SHAPED_DRAWS",
    "gather_rows",
    "local_rows",
    "rank_counts",
    "row_range",
    "split_counts",
    "split_rows",
    "wrap_dropout",
    "wrap_shaped_draw",
]


def _to_tensor(x):
    return None if x is None else compat.torch_core().convert_to_tensor(x)


def local_rows(batch, distribution, shard=None):
    """`(this process's rows of batch, how many, global rows or None)`."""
    from keras.src import tree

    leaves = [x for x in tree.flatten(batch) if x is not None]
    total = int(leaves[0].shape[0]) if leaves else 0
    if shard is not None or not distribution.auto_shard_dataset:
        local = tree.map_structure(_to_tensor, batch)
        return local, total, None if shard is None else shard.total
    start, length = row_range(total)

    def cut(x):
        return None if x is None else _to_tensor(x)[start : start + length]

    return tree.map_structure(cut, batch), length, total


def split_counts(total):
    """Each rank's rows of a global batch of `total`, in rank order."""
    size, _ = world()
    return [total // size + (rank < total % size) for rank in range(size)]


def rank_counts(rows, global_rows):
    """Every rank's rows, in rank order (`global_rows=None`: gathered)."""
    if global_rows is None:
        return all_gather_ints(rows)
    return split_counts(global_rows)


def row_range(total):
    """`(start, length)` of this process's rows of a global batch."""
    counts = split_counts(total)
    rank = world()[1]
    return sum(counts[:rank]), counts[rank]


def gather_rows(outputs, counts):
    """Each rank's rows of `outputs` (nested), `counts`, in global order."""
    from keras.src import tree

    widest = max(counts)

    def gather(x):
        padded = x.new_zeros((widest, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat(
            [part[:n] for part, n in zip(parts, counts, strict=True)]
        )

    return tree.map_structure(gather, outputs)


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


_ROWS = contextvars.ContextVar("keras_dtensor_random_rows", default=None)


@contextlib.contextmanager
def split_rows(rows, total):
    """Seeded draws inside are this rank's `rows` of `total` (or whole)."""
    split = None
    if total is not None and rows != total:
        split = (row_range(total)[0], rows, total)
    with context.scoped(_ROWS, split):
        yield


def _split_of(seed, shape=None):
    """`(start, length, total)` of a seeded draw to split, else `None`."""
    # Before the ContextVar read, which torch.compile cannot trace.
    if context.current() is None:
        return None
    split = _ROWS.get()
    if split is None or seed is None:
        return None
    from keras.src.random.seed_generator import SeedGenerator

    if isinstance(seed, SeedGenerator) and seed._initial_seed is None:
        return None  # unseeded
    if shape is not None and (not shape or shape[0] != split[1]):
        return None
    return split


def wrap_shaped_draw(original):
    """Wraps `random.<draw>(shape, ..., seed=None)` (see above)."""

    @functools.wraps(original)
    def draw(shape, *args, **kwargs):
        split = _split_of(kwargs.get("seed"), tuple(shape))
        if split is None:
            return original(shape, *args, **kwargs)
        start, length, total = split
        whole = original((total, *tuple(shape)[1:]), *args, **kwargs)
        return whole[start : start + length]

    return draw


def wrap_dropout(original):
    """Wraps `random.dropout(inputs, rate, noise_shape=None, seed=None)`."""

    @functools.wraps(original)
    def dropout(inputs, rate, noise_shape=None, seed=None):
        split = None if rate in (0.0, 1.0) else _split_of(seed)
        if split is None or inputs.device.type == "meta":
            return original(inputs, rate, noise_shape, seed)
        shape = tuple(inputs.shape)
        if noise_shape is not None:
            shape = tuple(
                n if d is None else d
                for n, d in zip(shape, noise_shape, strict=True)
            )
        start, length, total = split
        if not shape or shape[0] != length:
            return original(inputs, rate, noise_shape, seed)
        # The global mask as one process draws it, cut to this rank's rows.
        from keras.src.backend.torch.random import torch_seed_generator

        keep_prob = 1.0 - rate
        whole = torch.full((total, *shape[1:]), keep_prob, device=inputs.device)
        mask = torch.bernoulli(whole, generator=torch_seed_generator(seed))
        mask = mask[start : start + length].bool()
        return torch.where(
            torch.broadcast_to(mask, inputs.shape),
            inputs / keep_prob,
            torch.zeros_like(inputs, dtype=inputs.dtype),
        )

    return dropout
