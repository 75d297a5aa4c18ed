"""A batch laid out by the distribution: arrays become batch-sharded
DTensors.

Every array of a batch gets the distribution's data layout for its rank
(`Distribution.get_data_layout`), cached on the distribution object. The
batch is either the global one, the same on every process, or this
process's slice of it (`per_process`).
"""

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from keras_dtensor import compat
from keras_dtensor.backend import object_state
from keras_dtensor.backend import structure
from keras_dtensor.backend.distribution_lib import as_backend_layout
from keras_dtensor.backend.distribution_lib import distribute_data_input
from keras_dtensor.backend.shards import shard_global_tensor

__all__ = ["distribute_batch"]

_LAYOUTS = "_keras_dtensor_data_layouts"


def _data_layout(distribution, ndim):
    """The batch layout for `ndim`, cached on the distribution object."""
    cache = object_state.get_on(distribution, _LAYOUTS)
    if cache is None:
        cache = object_state.set_on(distribution, _LAYOUTS, {})
    if ndim not in cache:
        layout = distribution.get_data_layout((None,) * ndim)
        cache[ndim] = as_backend_layout(layout)
    return cache[ndim]


def _distribute_leaf(x, distribution, per_process):
    if isinstance(x, DTensor) or x is None:
        return x
    if isinstance(x, np.ndarray) or (
        isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter)
    ):
        convert_to_tensor = compat.torch_core().convert_to_tensor

        x = convert_to_tensor(x)
        if x.ndim == 0:
            return x
        layout = _data_layout(distribution, x.ndim)
        if per_process:
            return distribute_data_input(x, layout, distribution.batch_dim_name)
        return shard_global_tensor(x, layout)
    return x


def distribute_batch(batch, distribution, per_process=False):
    """Converts every array in a batch to a DTensor sharded by batch.

    Args:
        batch: a nested structure of arrays and tensors.
        distribution: the active `keras.distribution.Distribution`.
        per_process: whether the batch is this process's slice (else it
            is the global batch, identical on every process).

    Returns:
        The same structure with `DTensor` leaves.
    """
    return structure.map_structure(
        lambda x: _distribute_leaf(x, distribution, per_process), batch
    )
