"""Writing a sharded variable into a Keras `.h5` store without gathering it.

Every rank writes each value in the same order: rank 0 fills the dataset
in blocks, each part from the lowest rank holding it. A rank whose write
fails keeps taking part; the save raises at the end.
"""

import contextlib
import contextvars
import dataclasses
import itertools
import math

import ml_dtypes  # a Keras dependency
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras_dtensor import config
from keras_dtensor.backend import context
from keras_dtensor.backend import layout
from keras_dtensor.saving import shm_blocks

__all__ = [
    "current",
    "end_save",
    "new_save",
    "numpy_dtype",
    "pieces",
    "scope",
    "shard_owners",
    "streamable",
    "write",
]


_ALIGN = 16  # bytes: any dtype may start at a multiple of this


def _carve(flat, offset, shape, dtype):
    """A tensor of `shape` and `dtype` over `flat`'s bytes from `offset`."""
    nbytes = math.prod(shape) * dtype.itemsize
    return flat[offset : offset + nbytes].view(dtype).view(shape)


@dataclasses.dataclass
class _Save:
    """One save on this rank: its first write error and buffers."""

    piece_bytes: int
    slot_bytes: int  # a piece's, rounded up to `_ALIGN`
    error: BaseException | None = None
    buffers: dict = dataclasses.field(default_factory=dict)
    shared: object = None  # `shm_blocks.Shared`, if any
    shared_ranks: frozenset | None = None  # None: not tried yet

    def buffer(self, device, blocks):
        key = (device, blocks)
        if key not in self.buffers:
            size = blocks * self.slot_bytes
            self.buffers[key] = torch.empty(
                size, dtype=torch.uint8, device=device
            )
        return self.buffers[key]


_SAVE = contextvars.ContextVar("keras_dtensor_stream_save", default=None)


def new_save():
    """One save's state on this rank; `end_save` when done."""
    piece = max(1, int(config.get("SAVE_PIECE_MB") * 2**20))
    return _Save(piece, -(-max(piece, _ALIGN) // _ALIGN) * _ALIGN)


def end_save(state):
    """Releases `state`'s shared memory; idempotent."""
    shared, state.shared = state.shared, None
    if shared is not None:
        shared.close()


@contextlib.contextmanager
def scope():
    """One save on every rank, its stores writing here; yields its state."""
    state = new_save()
    try:
        with context.scoped(_SAVE, state):
            yield state
    finally:
        end_save(state)


def current():
    """The state of the save this thread is in (`scope()`), or `None`."""
    return _SAVE.get()


def pieces(shape, itemsize, piece_bytes):
    """Contiguous blocks of a C-order array of at most `piece_bytes` (or
    one element), as `[(start, stop) per dim]`, in file order.

    Example:
    >>> pieces((4, 3), 4, 24)
    [[(0, 2), (0, 3)], [(2, 4), (0, 3)]]
    """
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return []
    split, inner = len(shape), itemsize
    while split > 0 and inner * shape[split - 1] <= piece_bytes:
        split -= 1
        inner *= shape[split]
    if split == 0:
        return [[(0, n) for n in shape]]
    dim = split - 1  # cut into runs; dims after it whole
    step = max(1, piece_bytes // inner)
    whole = [(0, n) for n in shape[split:]]
    return [
        [(i, i + 1) for i in outer]
        + [(start, min(start + step, shape[dim]))]
        + whole
        for outer in itertools.product(*(range(n) for n in shape[:dim]))
        for start in range(0, shape[dim], step)
    ]


def shard_owners(shape, mesh, placements):
    """Sorted `[(rank, ranges), ...]`: each distinct non-empty shard's
    `(start, length)` per dim, and the lowest rank holding it."""
    ranks = mesh.mesh
    owners = {}
    for coordinate in itertools.product(*(range(n) for n in ranks.shape)):
        ranges = tuple(
            layout.local_slices(
                shape, mesh, placements, coordinate=list(coordinate)
            )
        )
        if any(n == 0 for _, n in ranges):
            continue
        rank = int(ranks[coordinate])
        owners[ranges] = min(rank, owners.get(ranges, rank))
    return sorted((rank, ranges) for ranges, rank in owners.items())


def _overlap(block, ranges):
    """`(index in the block, index in the shard)`, or `None`."""
    in_block, in_shard = [], []
    for (b0, b1), (r0, n) in zip(block, ranges, strict=True):
        lo, hi = max(b0, r0), min(b1, r0 + n)
        if hi <= lo:
            return None
        in_block.append(slice(lo - b0, hi - b0))
        in_shard.append(slice(lo - r0, hi - r0))
    return tuple(in_block), tuple(in_shard)


def numpy_dtype(dtype):
    """The numpy dtype Keras stores a torch `dtype` as (bfloat16 too)."""
    if dtype == torch.bfloat16:
        return np.dtype(ml_dtypes.bfloat16)
    return torch.empty((), dtype=dtype).numpy().dtype


def _put(state, dataset, block, buffer):
    """Rank 0 writes `buffer` as `block` unless a write failed."""
    if state.error is not None:
        return
    if buffer.device.type != "cpu":
        staging = state.buffer(torch.device("cpu"), 1)
        staged = _carve(staging, 0, buffer.shape, buffer.dtype)
        buffer = staged.copy_(buffer)
    try:
        if buffer.dtype == torch.bfloat16:  # bitwise: numpy has no bfloat16
            buffer = buffer.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        dataset[tuple(slice(a, b) for a, b in block)] = np.asarray(buffer)
    except Exception as e:
        state.error = e


def _receive(target, slot, offset, rank):
    """Rank 0: `rank`'s part into `target` (via `slot` if strided)."""
    into = target
    if not target.is_contiguous():
        into = _carve(slot, offset, target.shape, target.dtype)
    dist.recv(into, src=rank)
    if into is not target:
        target.copy_(into)


def _assemble(state, local, blocks, owners, shared):
    """Rank 0: yields `(block, values)` in file order, every part in."""
    parts = [
        [
            (rank, found)
            for rank, ranges in owners
            if rank != 0 and (found := _overlap(block, ranges)) is not None
        ]
        for block in blocks
    ]
    own = [ranges for rank, ranges in owners if rank == 0]
    for i in range(min(shm_blocks.SLOTS, len(blocks)) if shared else 0):
        shm_blocks.grant(shared, i, parts[i])
    for i, block in enumerate(blocks):
        shape = tuple(b - a for a, b in block)
        found = _overlap(block, own[0]) if own else None
        mine = local[found[1]] if found else None
        if mine is not None and mine.shape == shape and mine.is_cpu:
            yield block, mine  # all of it is here: no copy
        else:
            if shared:
                slot = shared.slots[i % shm_blocks.SLOTS]
            else:
                slot = state.buffer(local.device, 2)
            values = _carve(slot, 0, shape, local.dtype)
            if found:
                values[found[0]].copy_(mine)
            for rank, (in_block, _) in parts[i]:
                if shared:
                    shm_blocks.hear(shared, rank, i)
                else:
                    _receive(values[in_block], slot, state.slot_bytes, rank)
            yield block, values
        after = i + shm_blocks.SLOTS
        if shared and after < len(blocks):
            shm_blocks.grant(shared, after, parts[after])


def _send(local, blocks, ranges, shared):
    """Another rank: its shard's part of every block to rank 0."""
    works = []
    for i, block in enumerate(blocks):
        found = _overlap(block, ranges)
        if found is None:
            continue
        part = local[found[1]]
        if shared is None:
            works.append(dist.isend(part.contiguous(), dst=0))
            continue
        slot = shm_blocks.free_slot(shared, i)
        shape = tuple(b - a for a, b in block)
        _carve(slot, 0, shape, local.dtype)[found[0]].copy_(part)
        shm_blocks.part_in(shared, i)
    for work in works:
        work.wait()


def streamable(dtensor):
    """Whether `write` takes it (a partial sum is left to Keras)."""
    return all(type(p) in (Shard, Replicate) for p in dtensor.placements)


def write(store, key, value, state):
    """Writes DTensor `value` as `store[key]`, every rank taking part."""
    owners = shard_owners(value.shape, value.device_mesh, value.placements)
    local = value.to_local()
    blocks = pieces(value.shape, value.element_size(), state.piece_bytes)
    rank = dist.get_rank()
    dataset = None
    if state.error is None:
        try:
            if not store._h5_entry_initialized:
                store._create_h5_group(store._h5_entry_path)
            dataset = store._h5_entry_group.create_dataset(
                key, shape=tuple(value.shape), dtype=numpy_dtype(value.dtype)
            )
            if value.dtype == torch.bfloat16:
                dataset.attrs["dtype"] = "bfloat16"  # as Keras marks it
        except Exception as e:
            state.error = e
    if value.device_mesh.device_type == "cpu" and state.shared_ranks is None:
        state.shared, state.shared_ranks = shm_blocks.attach(state.slot_bytes)
    ranks = state.shared_ranks or ()  # those that opened the buffers
    usable = 0 in ranks and local.is_cpu and all(r in ranks for r, _ in owners)
    shared = state.shared if usable else None
    if rank == 0:
        for block, values in _assemble(state, local, blocks, owners, shared):
            _put(state, dataset, block, values)
        return
    mine = [ranges for owner, ranges in owners if owner == rank]
    if mine:
        _send(local, blocks, mine[0], shared)
