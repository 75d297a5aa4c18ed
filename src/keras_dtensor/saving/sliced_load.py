"""Loading Keras weight files under a distribution: each rank reads its slices.

The store hands out a `SlicedDataset`, a whole array to numpy; a sharded
variable's `assign` reads only this rank's slices of it.
"""

import functools

import ml_dtypes  # a Keras dependency
import numpy as np
import torch
from torch.distributed.tensor import DTensor

from keras_dtensor import compat
from keras_dtensor.backend import context
from keras_dtensor.backend import shards
from keras_dtensor.backend.launch import multi_process
from keras_dtensor.backend.layout import local_slices

__all__ = [
    "SlicedDataset",
    "wrap_convert_variable_value",
    "wrap_h5_store_getitem",
]


class SlicedDataset:
    """An h5py dataset (`bfloat16`: stored by Keras as raw uint16) that
    reads only the region asked for."""

    def __init__(self, dataset, bfloat16=False):
        self._dataset = dataset
        self._bfloat16 = bfloat16
        self.shape = tuple(dataset.shape)
        self.ndim = len(self.shape)
        self.dtype = np.dtype(ml_dtypes.bfloat16) if bfloat16 else dataset.dtype

    def read(self, ranges):
        """The region `[(start, length), ...]` (one pair per dim)."""
        if any(n == 0 for _, n in ranges):
            return np.empty(tuple(n for _, n in ranges), dtype=self.dtype)
        return self[tuple(slice(start, start + n) for start, n in ranges)]

    def __getitem__(self, index):
        array = np.asarray(self._dataset[index])
        return array.view(ml_dtypes.bfloat16) if self._bfloat16 else array

    def __len__(self):
        return self.shape[0]

    def __array__(self, dtype=None, copy=None):
        array = self[()]
        return array if dtype is None else array.astype(dtype)


def wrap_h5_store_getitem(original):
    """Wraps `H5IOStore.__getitem__`: a `SlicedDataset` under a sharding
    distribution on several processes."""

    @functools.wraps(original)
    def __getitem__(self, key):
        distribution = context.current()
        if (
            distribution is None
            or context.is_data_parallel(distribution)
            or not multi_process()
        ):
            return original(self, key)
        from keras.src.saving import saving_lib

        dataset = saving_lib.safe_get_h5_dataset(self._h5_entry_group, key)
        bfloat16 = dataset.attrs.get("dtype") == "bfloat16"
        return SlicedDataset(dataset, bfloat16=bfloat16)

    return __getitem__


def wrap_convert_variable_value(original):
    """Wraps torch `Variable._convert_to_tensor(value, dtype)`."""

    @functools.wraps(original)
    def _convert_to_tensor(self, value, dtype=None):
        if not isinstance(value, SlicedDataset):
            return original(self, value, dtype=dtype)
        current = getattr(self, "_value", None)
        if (
            isinstance(current, DTensor)
            and tuple(current.shape) == value.shape
            and any(not p.is_replicate() for p in current.placements)
        ):
            mesh, placements = current.device_mesh, current.placements
            ranges = local_slices(value.shape, mesh, placements)
            local = torch.as_tensor(np.ascontiguousarray(value.read(ranges)))
            dtype = compat.torch_core().to_torch_dtype(self._dtype)
            local = local.to(device=current.device, dtype=dtype)
            return shards.from_local(local, mesh, placements, current.shape)
        return original(self, np.asarray(value), dtype=dtype)

    return _convert_to_tensor
