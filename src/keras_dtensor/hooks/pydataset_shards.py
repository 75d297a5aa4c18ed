"""A `PyDataset` built 1/N per process: rank `k % N` builds step `k`'s batch
and scatters each rank its rows (the structure as JSON, nothing
unpickled), tagged with their place (`batch_layout.tag_shard`).
"""

import collections
import copy
import itertools
import json
import zlib
from concurrent import futures

import numpy as np
import torch
import torch.distributed as dist

from keras_dtensor.backend import fast_tree
from keras_dtensor.backend import object_state
from keras_dtensor.backend.batch_layout import tag_shard
from keras_dtensor.backend.launch import broadcast_bytes
from keras_dtensor.backend.launch import world
from keras_dtensor.hooks.loader_shards import Reiterable
from keras_dtensor.hooks.loader_shards import rows_of
from keras_dtensor.hooks.loader_shards import shard_rule

__all__ = ["sharded_batches", "take_over_workers"]


def sharded_batches(adapter, distribution):
    """This process's shards of `adapter`'s batches, or `None` where they
    are read whole (unknown length, `use_multiprocessing`, no
    `shard_rule`)."""
    if adapter.enqueuer is not None or not _shardable(adapter, distribution):
        return None
    rule = shard_rule(distribution)
    return Reiterable(lambda: _shards(adapter, rule))


def take_over_workers(adapter, distribution):
    """Stands down Keras's enqueuer (it builds every batch) where
    `sharded_batches` shards; `_owned` runs the threads."""
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
            total = _leading_rows(batch)
            start, length = rule(total, rank)
            batch = rows_of(batch, start, length)
        else:
            batch, start, total = batch
        yield tag_shard(batch, start, total, zlib.crc32(str(index).encode()))


def _owned(adapter, indices):
    """This rank's batches, in order; with `workers > 1` built by that many
    threads, ahead by one more after each taken, up to `max_queue_size`."""
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
    """The structure, shapes and dtypes of a batch, JSON-ready; its leaves
    appended to `leaves` as tensors."""
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
    """This rank's rows of the owner's `batch`: `(shard, start, total)`, or
    `None` when the batch cannot be scattered."""
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


def _leading_rows(batch):
    leaves = fast_tree.flatten(batch)
    return next((int(np.shape(x)[0]) for x in leaves if np.ndim(x)), None)
