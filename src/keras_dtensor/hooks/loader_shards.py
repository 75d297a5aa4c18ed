"""This process's rows of each global batch, loaded alone and tagged."""

import collections
import copy
import itertools
import json
import zlib
from concurrent import futures

import numpy as np
import torch
import torch.distributed as dist
from torch.utils import data as torch_data

from keras_dtensor import config
from keras_dtensor import data_parallel
from keras_dtensor.backend import context
from keras_dtensor.backend import fast_tree
from keras_dtensor.backend import object_state
from keras_dtensor.backend.batch_layout import data_placements
from keras_dtensor.backend.batch_layout import tag_shard
from keras_dtensor.backend.launch import broadcast_bytes
from keras_dtensor.backend.launch import world
from keras_dtensor.backend.layout import local_slices

__all__ = [
    "shard_rule",
    "sharded_batches",
    "sharded_loader",
    "take_over_workers",
]

_DERIVED = "_keras_dtensor_sharded_loader"


def sharded_loader(loader, distribution):
    """This process's shards of an epoch of `loader`, or `None`."""
    if loader.batch_sampler is None or isinstance(
        loader.dataset, torch_data.IterableDataset
    ):
        return None
    rule = shard_rule(distribution)
    if rule is None:
        return None
    cached = object_state.get_on(loader, _DERIVED)
    if cached is not None and cached[0] is distribution:
        return _tagged(iter(cached[1]))
    workers = loader.num_workers
    keyed = _Keyed(loader.dataset, loader.collate_fn)
    derived = torch_data.DataLoader(
        keyed,
        batch_sampler=_ShardIndices(loader.batch_sampler, rule, world()[1]),
        num_workers=workers,
        collate_fn=keyed.collate,
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
    return _tagged(iter(derived))


def _tagged(iterator):
    for batch, (start, total, digest, empty) in iterator:
        if empty:  # zero rows of the sample that stood in
            batch = _rows_of(batch, 0, 0)
        yield tag_shard(batch, start, total, digest)


def shard_rule(distribution):
    """`(total, rank) -> (start, length)`, or `None` (read whole)."""
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


class _ShardIndices:
    """The user's batch sampler, cut to this process's shard."""

    def __init__(self, batch_sampler, rule, rank):
        self.batch_sampler, self.rule, self.rank = batch_sampler, rule, rank

    def __len__(self):
        return len(self.batch_sampler)

    def __iter__(self):
        for indices in self.batch_sampler:
            indices = list(indices)
            start, length = self.rule(len(indices), self.rank)
            try:  # positions: their bytes, far cheaper than their repr
                raw = np.asarray(indices, dtype=np.int64).tobytes()
            except (TypeError, ValueError, OverflowError):  # other keys
                raw = repr(indices).encode()
            digest = zlib.crc32(raw)
            meta = (start, len(indices), digest, not length)
            yield indices[start : start + length] or [indices[0]], meta


class _Keyed(torch_data.Dataset):
    """The user's dataset and `collate_fn` on `_ShardIndices`'s keys."""

    def __init__(self, dataset, collate_fn):
        self.dataset, self.collate_fn = dataset, collate_fn

    def __getitems__(self, key):
        indices, meta = key
        if getattr(self.dataset, "__getitems__", None):
            return self.dataset.__getitems__(indices), meta
        return [self.dataset[i] for i in indices], meta

    def collate(self, fetched):
        return self.collate_fn(fetched[0]), fetched[1]


def _rows_of(batch, start, length):
    """Rows `[start, start + length)` of every array of a batch."""

    def cut(x):
        if isinstance(x, (torch.Tensor, np.ndarray)) and x.ndim:
            return x[start : start + length]
        return x

    return fast_tree.map_structure(cut, batch)


def sharded_batches(adapter, distribution):
    """This process's shards of an epoch of `adapter`, or `None`."""
    if adapter.enqueuer is not None or not _shardable(adapter, distribution):
        return None
    return _shards(adapter, shard_rule(distribution))


def take_over_workers(adapter, distribution):
    """Stands down Keras's enqueuer (it builds every batch)."""
    if adapter.enqueuer is not None and _shardable(adapter, distribution):
        object_state.set_on(adapter, "enqueuer", None)


def _shardable(adapter, distribution):
    py_dataset = adapter.py_dataset
    return (
        py_dataset.num_batches is not None
        and not py_dataset.use_multiprocessing
        and shard_rule(distribution) is not None
    )


class _Indices:
    """Stands in for the user's `PyDataset`: item `i` is the index `i`."""

    def __init__(self, py_dataset):
        self.num_batches = py_dataset.num_batches

    def __getitem__(self, index):
        return np.asarray(index)


def _order(adapter):
    """The epoch's batch indices, drawn by Keras's own generator."""
    stand_in = copy.copy(adapter)
    stand_in.py_dataset = _Indices(adapter.py_dataset)
    stand_in.class_weight = None
    return [int(b[0]) for b in stand_in._finite_generator()]


def _shards(adapter, rule):
    # A generator: the order is drawn at the first batch, as Keras's is.
    size, rank = world()
    order = _order(adapter)
    owned = _owned(adapter, order[rank::size])
    built = None
    for k, index in enumerate(order):
        owner = k % size
        if owner == 0:  # a new group: every rank takes its batch of it
            built = next(owned) if k + rank < len(order) else None
        batch = _receive(built if owner == rank else None, owner, rule)
        if batch is None:  # not scatterable: every rank builds it
            batch = _build(adapter, index)
            leaves = fast_tree.flatten(batch)
            rows = (int(np.shape(x)[0]) for x in leaves if np.ndim(x))
            total = next(rows, None)
            start, length = rule(total, rank)
            batch = _rows_of(batch, start, length)
        else:
            batch, start, total = batch
        yield tag_shard(batch, start, total, zlib.crc32(str(index).encode()))


def _owned(adapter, indices):
    """This rank's batches, built ahead by `workers` threads."""
    py_dataset = adapter.py_dataset
    if py_dataset.workers <= 1:
        yield from (_build(adapter, index) for index in indices)
        return
    pool = futures.ThreadPoolExecutor(py_dataset.workers)
    limit = max(1, py_dataset.max_queue_size)
    ahead, pending = collections.deque(), iter(indices)
    try:
        for taken in itertools.count(1):
            while len(ahead) < min(taken, limit):
                index = next(pending, None)
                if index is None:
                    break
                ahead.append(pool.submit(_build, adapter, index))
            if not ahead:
                return
            yield ahead.popleft().result()
    finally:  # an iterator dropped early (Keras's first-batch build)
        pool.shutdown(wait=False, cancel_futures=True)


def _build(adapter, index):
    return adapter._standardize_batch(adapter.py_dataset[index])


class _Unsupported(Exception):
    pass


def _spec(x, leaves):
    """A batch's structure, shapes and dtypes; its leaves to `leaves`."""
    if x is None:
        return None
    if isinstance(x, (tuple, list)):
        kind = "tuple" if type(x).__name__ == "tuple" else "list"
        return {kind: [_spec(v, leaves) for v in x]}
    if isinstance(x, dict):
        if not all(isinstance(k, str) for k in x):
            raise _Unsupported
        return {"dict": {k: _spec(v, leaves) for k, v in x.items()}}
    if isinstance(x, torch.Tensor):
        x = x.numpy() if x.dtype != torch.bfloat16 else None
    array = np.asarray(x) if x is not None else None
    if array is None or array.ndim == 0 or array.dtype.kind not in "iuf":
        raise _Unsupported
    leaves.append(torch.as_tensor(array))
    return {"shape": list(array.shape), "dtype": array.dtype.str}


def _rebuild(spec, leaf):
    """The structure of `spec`, `leaf(leaf_spec)` at each leaf, in order."""
    if spec is None:
        return None
    if "dict" in spec:
        return {k: _rebuild(s, leaf) for k, s in spec["dict"].items()}
    if "tuple" in spec:
        return tuple(_rebuild(s, leaf) for s in spec["tuple"])
    if "list" in spec:
        return [_rebuild(s, leaf) for s in spec["list"]]
    return leaf(spec)


def _receive(batch, owner, rule):
    """`(shard, start, total)` of the owner's `batch`, or `None`."""
    size, rank = world()
    text, leaves = None, []
    if rank == owner:
        try:
            text = json.dumps(_spec(batch, leaves))
        except _Unsupported:
            text = "null"
    spec = json.loads(broadcast_bytes(text and text.encode(), src=owner))
    if spec is None:
        return None
    leaf_specs = []
    _rebuild(spec, leaf_specs.append)
    total = leaf_specs[0]["shape"][0]
    shards = [rule(total, r) for r in range(size)]
    widest = max(length for _, length in shards)
    start, length = shards[rank]
    received = []
    for i, leaf_spec in enumerate(leaf_specs):
        dtype = torch.from_numpy(np.empty(0, leaf_spec["dtype"])).dtype
        out = torch.empty((widest, *leaf_spec["shape"][1:]), dtype=dtype)
        chunks = None
        if rank == owner:
            chunks = [out.new_zeros(out.shape) for _ in shards]
            for chunk, (s, n) in zip(chunks, shards, strict=True):
                chunk[:n] = leaves[i][s : s + n]
        dist.scatter(out, chunks, src=owner)
        received.append(out[:length])
    received = iter(received)
    return _rebuild(spec, lambda _: next(received)), start, total
