"""A map-style `DataLoader` loading only this process's rows: every rank
draws the global batch's indices, then fetches and collates its shard.
"""

import zlib

import numpy as np
import torch
from torch.utils import data as torch_data

from keras_dtensor import config
from keras_dtensor import data_parallel
from keras_dtensor.backend import context
from keras_dtensor.backend import fast_tree
from keras_dtensor.backend import object_state
from keras_dtensor.backend.batch_layout import data_placements
from keras_dtensor.backend.batch_layout import tag_shard
from keras_dtensor.backend.launch import world
from keras_dtensor.backend.layout import local_slices

__all__ = ["Reiterable", "rows_of", "shard_rule", "sharded_loader"]

_DERIVED = "_keras_dtensor_sharded_loader"


def sharded_loader(loader, distribution):
    """This process's shards of `loader`'s batches, or `None` where it is
    read whole (an `IterableDataset`, no automatic batching, no
    `shard_rule`)."""
    if loader.batch_sampler is None or isinstance(
        loader.dataset, torch_data.IterableDataset
    ):
        return None
    rule = shard_rule(distribution)
    if rule is None:
        return None
    cached = object_state.get_on(loader, _DERIVED)
    if cached is not None and cached[0] is distribution:
        return _epochs(cached[1])
    workers = loader.num_workers
    derived = torch_data.DataLoader(
        _Keyed(loader.dataset),
        batch_sampler=_ShardIndices(loader.batch_sampler, rule, world()[1]),
        num_workers=workers,
        collate_fn=_Collate(loader.collate_fn),
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
        in_order=getattr(loader, "in_order", True),
    )
    object_state.set_on(loader, _DERIVED, (distribution, derived))
    return _epochs(derived)


class Reiterable:
    """Iterates `make()` each time, as Keras iterates its loader."""

    def __init__(self, make):
        self.make = make

    def __iter__(self):
        return self.make()


def _epochs(derived):
    # iter() when iterated: the loader draws its seed then.
    return Reiterable(lambda: _tagged(iter(derived)))


def _tagged(iterator):
    for batch, (start, total, digest, empty) in iterator:
        if empty:  # zero rows of the sample that stood in
            batch = rows_of(batch, 0, 0)
        yield tag_shard(batch, start, total, digest)


def shard_rule(distribution):
    """`(total, rank) -> (start, length)`: a rank's rows of a global batch,
    or `None` where the batch is read whole: one process, not split by its
    leading dim alone, or `KERAS_DTENSOR_SHARDED_LOADING=0`."""
    if not config.get("SHARDED_LOADING") or world()[0] == 1:
        return None
    if context.is_data_parallel(distribution):

        def row_shard(total, rank):
            counts = data_parallel.split_counts(total)
            return sum(counts[:rank]), counts[rank]

        return row_shard
    placements, mesh = data_placements(distribution)
    if any(p.is_shard() and p.dim != 0 for p in placements):
        return None
    if not any(p.is_shard() for p in placements):
        return None  # replicated: every rank loads it whole
    coordinates = {
        int(mesh.mesh[c]): list(c) for c in np.ndindex(*mesh.mesh.shape)
    }

    def shard_of(total, rank):
        return local_slices((total,), mesh, placements, coordinates[rank])[0]

    return shard_of


def _digest(indices):
    try:
        raw = np.asarray(indices)
        if raw.dtype.kind in "biu":
            return zlib.crc32(raw.astype(np.int64).tobytes())
    except (TypeError, ValueError):
        pass
    return zlib.crc32(repr(list(indices)).encode())


class _ShardIndices:
    """The user's batch sampler, cut to this process's shard: `(indices,
    (start, total, digest, empty))`; an empty shard fetches one sample."""

    def __init__(self, batch_sampler, rule, rank):
        self.batch_sampler, self.rule, self.rank = batch_sampler, rule, rank

    def __len__(self):
        return len(self.batch_sampler)

    def __iter__(self):
        for indices in self.batch_sampler:
            indices = list(indices)
            start, length = self.rule(len(indices), self.rank)
            meta = (start, len(indices), _digest(indices), not length)
            yield indices[start : start + length] or [indices[0]], meta


class _Keyed(torch_data.Dataset):
    """The user's dataset, fetched by `_ShardIndices`'s keys."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getitems__(self, key):
        indices, meta = key
        if getattr(self.dataset, "__getitems__", None):
            return self.dataset.__getitems__(indices), meta
        return [self.dataset[i] for i in indices], meta


class _Collate:
    """The user's `collate_fn` on the fetched samples."""

    def __init__(self, collate_fn):
        self.collate_fn = collate_fn

    def __call__(self, fetched):
        return self.collate_fn(fetched[0]), fetched[1]


def rows_of(batch, start, length):
    """Rows `[start, start + length)` of every array of a batch."""

    def cut(x):
        if isinstance(x, (torch.Tensor, np.ndarray)) and x.ndim:
            return x[start : start + length]
        return x

    return fast_tree.map_structure(cut, batch)
