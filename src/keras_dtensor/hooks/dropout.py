"""Dropout on a split activation: one process's mask, each rank its part."""

import functools

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor import data_parallel
from keras_dtensor.backend.layout import local_slices
from keras_dtensor.backend.shards import from_local

__all__ = ["wrap_dropout"]


def _seeded(seed, noise_shape):
    """Whether Keras's torch dropout draws from the seed (not torch's)."""
    from keras.src.random.seed_generator import SeedGenerator

    unseeded = isinstance(seed, SeedGenerator) and seed._initial_seed is None
    return noise_shape is not None or not (seed is None or unseeded)


def _split_dropout(original, inputs, rate, noise_shape, seed):
    shape = tuple(inputs.shape)
    mesh, placements = inputs.device_mesh, inputs.placements
    ones = torch.ones(shape, dtype=inputs.dtype, device=inputs.device)
    drawn = original(ones, rate, noise_shape, seed)  # one process's draw
    ranges = local_slices(shape, mesh, placements)
    part = drawn[tuple(slice(start, start + n) for start, n in ranges)]
    local = inputs.to_local()
    if _seeded(seed, noise_shape):  # `where(mask, x / keep, 0)`, as Keras
        keep = 1.0 - rate
        out = torch.where(part != 0, local / keep, torch.zeros_like(local))
    else:  # `x * (mask / keep)`, as torch's dropout kernel
        out = local * part
    return from_local(out, mesh, placements, inputs.shape, inputs.stride())


def wrap_dropout(original):
    """Wraps `random.dropout(inputs, rate, noise_shape=None, seed=None)`."""
    inner = data_parallel.wrap_dropout(original)

    @functools.wraps(original)
    def dropout(inputs, rate, noise_shape=None, seed=None):
        if (
            isinstance(inputs, DTensor)
            and 0.0 < rate < 1.0
            and any(p.is_shard() for p in inputs.placements)
        ):
            return _split_dropout(original, inputs, rate, noise_shape, seed)
        return inner(inputs, rate, noise_shape, seed)

    return dropout
