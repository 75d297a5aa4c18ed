"""A batch laid out by the distribution as batch-sharded DTensors, from
the global batch, this process's slice or a tagged shard; no communication.
"""

import collections

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from keras_dtensor import compat
from keras_dtensor.backend import fast_tree
from keras_dtensor.backend import object_state
from keras_dtensor.backend.distribution_lib import as_backend_layout
from keras_dtensor.backend.distribution_lib import distribute_data_input
from keras_dtensor.backend.shards import from_local
from keras_dtensor.backend.shards import shard_global_tensor

__all__ = [
    "BatchShard",
    "batch_shard",
    "data_placements",
    "distribute_batch",
    "tag_shard",
]

_LAYOUTS = "_keras_dtensor_data_layouts"
_SHARD = "_keras_dtensor_batch_shard"


BatchShard = collections.namedtuple("BatchShard", ["start", "total", "digest"])
BatchShard.__doc__ = """Rows from `start` of a global batch of `total`, whose
indices have checksum `digest`."""


def _first_leaf(batch):
    return next((x for x in fast_tree.flatten(batch) if x is not None), None)


def tag_shard(batch, start, total, digest):
    """This process's shard `batch`, marked with its place (as tensors)."""

    def as_tensor(x):
        return torch.from_numpy(x) if isinstance(x, np.ndarray) else x

    batch = fast_tree.map_structure(as_tensor, batch)
    first = _first_leaf(batch)
    if isinstance(first, torch.Tensor):
        setattr(first, _SHARD, BatchShard(start, total, digest))
    return batch


def batch_shard(batch):
    """The `BatchShard` a batch was tagged with, or `None`."""
    return getattr(_first_leaf(batch), _SHARD, None)


def data_placements(distribution):
    """`(placements, mesh)` of the distribution's batch layout."""
    layout = _data_layout(distribution, 1)
    return tuple(layout.placements), layout.device_mesh


def _data_layout(distribution, ndim):
    cache = object_state.get_on(distribution, _LAYOUTS)
    if cache is None:
        cache = object_state.set_on(distribution, _LAYOUTS, {})
    if ndim not in cache:
        layout = distribution.get_data_layout((None,) * ndim)
        cache[ndim] = as_backend_layout(layout)
    return cache[ndim]


def _distribute_leaf(x, distribution, per_process, total=None):
    as_is = isinstance(x, (DTensor, torch.nn.Parameter))
    if as_is or not isinstance(x, (np.ndarray, torch.Tensor)):
        return x
    x = compat.torch_core().convert_to_tensor(x)
    if x.ndim == 0:
        return x
    layout = _data_layout(distribution, x.ndim)
    if total is not None:  # this rank's shard, loaded as such
        mesh, placements = layout.device_mesh, layout.placements
        shape = (total, *x.shape[1:])
        return from_local(x.contiguous(), mesh, placements, shape)
    if per_process:
        return distribute_data_input(x, layout, distribution.batch_dim_name)
    return shard_global_tensor(x, layout)


def distribute_batch(batch, distribution, per_process=False):
    """`batch` (global, or this process's slice) with arrays batch-sharded."""
    shard = batch_shard(batch)
    total = None if shard is None else shard.total
    return fast_tree.map_structure(
        lambda x: _distribute_leaf(x, distribution, per_process, total), batch
    )
