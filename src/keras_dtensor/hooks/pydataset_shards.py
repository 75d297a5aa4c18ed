"""A `PyDataset` built 1/N per process: each global batch is built by one
rank, which scatters every rank its shard of the rows.

A `PyDataset`'s `__getitem__` returns a whole batch, so the work is split
by batch: the epoch's batch order is Keras's own (its adapter's
generator, run on a stand-in dataset that only names indices, so the
shuffle draws as on one process), and in every group of N consecutive
steps each rank builds one batch, all ranks at once, the rank `k % N`
owning step `k`. At step `k` its owner sends each rank its rows
(`torch.distributed.scatter`, padded to the widest shard): a rank
receives only its shard's bytes, and builds 1/N of the batches, in
parallel with the others. The shard is tagged with its place in the
global batch (`backend.batch_layout.tag_shard`), with a checksum of the
batch's index for the cross-rank check, so the step computes one
process's numbers.

The batch's structure, shapes and dtypes travel as JSON from the owner
(nothing from a peer is unpickled). A batch with a leaf that cannot be
scattered (a string, a scalar, a key that is not a string) is built by
every rank instead. With `workers > 1` (threads), Keras's enqueuer,
which would build every batch, stands down (`take_over_workers`), and
that many threads build this rank's batches ahead. Read whole, as
before: a `PyDataset` of unknown length, one with `use_multiprocessing`
(its worker processes are Keras's), a data layout that splits more than
the batch dim, or `KERAS_DTENSOR_SHARDED_LOADING=0`.
"""

import collections
import copy
import json
import zlib
from concurrent import futures

import numpy as np
import torch
import torch.distributed as dist

from keras_dtensor import config
from keras_dtensor.backend import object_state
from keras_dtensor.backend.batch_layout import tag_shard
from keras_dtensor.backend.launch import broadcast_bytes
from keras_dtensor.backend.launch import world
from keras_dtensor.hooks.loader_shards import rows_of
from keras_dtensor.hooks.loader_shards import shard_rule

__all__ = ["sharded_batches", "take_over_workers"]


def sharded_batches(adapter, distribution):
    """An iterable of this process's shards of `adapter`'s batches, or
    `None` where they are read whole (see the module docstring).

    Args:
        adapter: Keras's `PyDatasetAdapter`.
        distribution: the active distribution (`auto_shard_dataset=True`).
    """
    if adapter.enqueuer is not None or not _shardable(adapter, distribution):
        return None
    return _Epoch(adapter, shard_rule(distribution))


def take_over_workers(adapter, distribution):
    """Stands down Keras's enqueuer of a `PyDataset` with thread workers
    that will be built 1/N per process: its threads would build every
    batch. This rank's batches are built by as many threads instead
    (`_owned`). Recorded, so `uninstall()` puts the enqueuer back."""
    if adapter.enqueuer is not None and _shardable(adapter, distribution):
        object_state.set_on(adapter, "enqueuer", None)


def _shardable(adapter, distribution):
    py_dataset = adapter.py_dataset
    return (
        config.get("SHARDED_LOADING")
        and world()[0] > 1
        and py_dataset.num_batches is not None
        and not py_dataset.use_multiprocessing
        and shard_rule(distribution) is not None
    )


class _Indices:
    """Stands in for the user's `PyDataset`: item `i` is the index `i`."""

    def __init__(self, py_dataset):
        self.num_batches = py_dataset.num_batches

    def __getitem__(self, index):
        return np.asarray(index)


class _Epoch:
    """One epoch's batches, re-iterable like Keras's adapter."""

    def __init__(self, adapter, rule):
        self.adapter, self.rule = adapter, rule

    def __iter__(self):
        return _shards(self.adapter, self.rule)


def _order(adapter):
    """The epoch's batch indices, drawn by Keras's own generator."""
    stand_in = copy.copy(adapter)
    stand_in.py_dataset = _Indices(adapter.py_dataset)
    stand_in.class_weight = None
    return [int(b[0]) for b in stand_in._finite_generator()]


def _shards(adapter, rule):
    # A generator: the order is drawn at the first batch, as Keras's
    # generator draws it (Keras makes and drops an iterator at each
    # epoch's end: it must not draw).
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
    """This rank's batches, in order: each built when asked for, or, for
    a `PyDataset` with `workers > 1`, by that many threads, ahead by one
    batch more after each one taken, up to `max_queue_size` (so an
    iterator dropped after its first batch, as Keras's first-batch build
    does, has built only that one)."""
    py_dataset = adapter.py_dataset
    if py_dataset.workers <= 1:
        for index in indices:
            yield _build(adapter, index)
        return
    pool = futures.ThreadPoolExecutor(py_dataset.workers)
    ahead = collections.deque()
    pending = iter(indices)
    taken = 0
    try:
        while True:
            while len(ahead) < min(
                taken + 1, max(1, py_dataset.max_queue_size)
            ):
                index = next(pending, None)
                if index is None:
                    break
                ahead.append(pool.submit(_build, adapter, index))
            if not ahead:
                return
            taken += 1
            yield ahead.popleft().result()
    finally:  # an iterator dropped early (Keras's first-batch build)
        pool.shutdown(wait=False, cancel_futures=True)


def _build(adapter, index):
    return adapter._standardize_batch(adapter.py_dataset[index])


class _Unsupported(Exception):
    pass


def _spec(x):
    """The structure, shapes and dtypes of a batch, JSON-ready."""
    if x is None:
        return None
    if isinstance(x, (tuple, list)):
        return {"seq": type(x).__name__, "items": [_spec(v) for v in x]}
    if isinstance(x, dict):
        if not all(isinstance(k, str) for k in x):
            raise _Unsupported
        return {"keys": list(x), "items": [_spec(v) for v in x.values()]}
    if isinstance(x, torch.Tensor):
        x = x.numpy() if x.dtype != torch.bfloat16 else None
    array = np.asarray(x) if x is not None else None
    if array is None or array.ndim == 0 or array.dtype.kind not in "iuf":
        raise _Unsupported
    return {"shape": list(array.shape), "dtype": array.dtype.str}


def _leaves(x, out):
    if x is None:
        return out
    if isinstance(x, (tuple, list)):
        for v in x:
            _leaves(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _leaves(v, out)
    else:
        out.append(torch.as_tensor(np.asarray(x)))
    return out


def _rebuild(spec, leaves):
    if spec is None:
        return None
    if "items" in spec and "keys" in spec:
        return {
            k: _rebuild(s, leaves)
            for k, s in zip(spec["keys"], spec["items"], strict=True)
        }
    if "items" in spec:
        items = [_rebuild(s, leaves) for s in spec["items"]]
        return tuple(items) if spec["seq"] == "tuple" else items
    return next(leaves)


def _receive(batch, owner, rule):
    """This rank's rows of the owner's `batch`: `(shard, start, total)`, or
    `None` when the batch cannot be scattered."""
    size, rank = world()
    text = None
    if rank == owner:
        try:
            text = json.dumps(_spec(batch))
        except _Unsupported:
            text = "null"
    spec = json.loads(broadcast_bytes(text and text.encode(), src=owner))
    if spec is None:
        return None
    leaf_specs = _leaf_specs(spec, [])
    total = leaf_specs[0]["shape"][0]
    shards = [rule(total, r) for r in range(size)]
    widest = max(length for _, length in shards)
    start, length = shards[rank]
    leaves = _leaves(batch, []) if rank == owner else None
    received = []
    for i, leaf_spec in enumerate(leaf_specs):
        dtype = torch.from_numpy(
            np.empty(0, np.dtype(leaf_spec["dtype"]))
        ).dtype
        out = torch.empty((widest, *leaf_spec["shape"][1:]), dtype=dtype)
        chunks = None
        if rank == owner:
            leaf = leaves[i]
            chunks = []
            for s, n in shards:
                chunk = out.new_zeros(out.shape)
                chunk[:n] = leaf[s : s + n]
                chunks.append(chunk)
        dist.scatter(out, chunks, src=owner)
        received.append(out[:length])
    return _rebuild(spec, iter(received)), start, total


def _leaf_specs(spec, out):
    if spec is None:
        return out
    if "items" in spec:
        for s in spec["items"]:
            _leaf_specs(s, out)
    else:
        out.append(spec)
    return out


def _leading_rows(batch):
    if isinstance(batch, (tuple, list, dict)):
        values = batch.values() if isinstance(batch, dict) else batch
        return next(
            (n for n in map(_leading_rows, values) if n is not None), None
        )
    array = np.asarray(batch) if batch is not None else None
    return int(array.shape[0]) if array is not None and array.ndim else None
