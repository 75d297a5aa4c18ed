"""Writing a sharded variable into a Keras `.h5` store without gathering it.

Keras's `H5IOStore.__setitem__` converts each variable to numpy: for a
sharded variable an all-gather, so every rank held each whole variable
(and a numpy copy) while saving. Inside a save on several processes
(`scope()`, entered by `collective.py`), every rank writes a DTensor-backed
value as follows, in the same order (Keras walks the same model):

- rank 0 creates the dataset (global shape and dtype; bfloat16 as Keras
  stores it) and fills it in blocks, each contiguous in the file and at
  most `$KERAS_DTENSOR_SAVE_PIECE_MB` MiB;
- one rank per distinct shard (rank 0 when it holds one: no message)
  sends rank 0 its part of each block point to point, a view of its
  shard; rank 0 receives the next block while it writes the current one
  (about four pieces held), the others hold nothing extra and leave the
  dataset of their scratch file empty.

On one host (CPU values, every rank with a part able to open rank 0's
files in `/dev/shm`), the blocks are assembled in shared memory instead
(`shm_blocks.py`): each rank copies its part straight into the block,
rank 0 writes it out; no bytes through sockets, no copy on rank 0 of
the others' parts.

Keras's stores hand their values here through the hooks in
`stores.py` (layers, optimizer slots, the sharded `.weights.json`
format). A replicated variable is
one shard rank 0 holds. Plain values (DataParallel) go through Keras.
A rank whose write fails (a full disk) keeps taking part in every later
transfer without writing, so no peer waits on it; the save raises that
error once Keras's writer returns.
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
from keras_dtensor.backend import layout
from keras_dtensor.saving import shm_blocks

__all__ = [
    "active",
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
    """One save on this rank: piece size, first write error, rank 0's
    buffers (allocated once per save: a piece allocated and freed per
    block grew glibc's heap without reuse)."""

    piece_bytes: int
    error: BaseException | None = None
    buffers: dict = dataclasses.field(default_factory=dict)
    shared: object = None  # `shm_blocks.Shared` of this save, if any
    shared_ranks: frozenset | None = None  # None: not tried yet

    @property
    def slot_bytes(self):
        return -(-max(self.piece_bytes, _ALIGN) // _ALIGN) * _ALIGN

    def slots(self, device):
        """Two buffers on `device`, each a block and room for receiving
        its parts that are not contiguous in the block."""
        if device not in self.buffers:
            size = 2 * self.slot_bytes + _ALIGN * dist.get_world_size()
            self.buffers[device] = [
                torch.empty(size, dtype=torch.uint8, device=device)
                for _ in range(2)
            ]
        return self.buffers[device]

    def staging(self):
        """A CPU buffer of one block, for blocks received on a GPU."""
        if "staging" not in self.buffers:
            self.buffers["staging"] = torch.empty(
                self.slot_bytes, dtype=torch.uint8
            )
        return self.buffers["staging"]


_SAVE = contextvars.ContextVar("keras_dtensor_stream_save", default=None)


def new_save():
    """The state of one save on this rank, for `write` (`end_save` when
    done): `state.error` is the first write error on this rank (`None`
    if none), to raise once the save's writer returns."""
    return _Save(max(1, int(config.get("SAVE_PIECE_MB") * 2**20)))


def end_save(state):
    """Releases what `state` holds (its shared-memory blocks); idempotent."""
    shared, state.shared = state.shared, None
    if shared is not None:
        shared.close()


@contextlib.contextmanager
def scope():
    """The scope of one save on every rank (entered by `collective.py`):
    the stores Keras opens inside stream into it. Yields `new_save()`."""
    state = new_save()
    token = _SAVE.set(state)
    try:
        yield state
    finally:
        _SAVE.reset(token)
        end_save(state)


def active() -> bool:
    """Whether this thread is inside a save's `scope()`."""
    return _SAVE.get() is not None


def current():
    """The state of the save this thread is in (`scope()`), or `None`."""
    return _SAVE.get()


def pieces(shape, itemsize, piece_bytes):
    """Blocks of a C-order array, each contiguous and at most `piece_bytes`.

    Trailing dims whole while they fit, the next one cut into runs, those
    before it one index at a time; at least one element per block.

    Args:
        shape: the array's shape.
        itemsize: bytes per element.
        piece_bytes: the largest block, in bytes.

    Returns:
        A list of blocks, each a list of `(start, stop)` per dim, covering
        the array in file order (none if it is empty).

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
    """The distinct non-empty shards of a DTensor and the rank sending each.

    Of the ranks holding one shard (its replicas), the lowest sends it;
    rank 0 when it holds one.

    Args:
        shape: the global shape.
        mesh: the torch `DeviceMesh`.
        placements: its placements (`Shard`/`Replicate` only).

    Returns:
        `[(rank, ranges), ...]` sorted by rank; `ranges` is `(start,
        length)` per dim of the global array.
    """
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
    """`(index in the block, index in the shard)` of their intersection, or
    `None`."""
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


def _to_numpy(tensor):
    """A CPU tensor's values as numpy, sharing memory (bfloat16 bitwise)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _put(state, dataset, block, buffer):
    """Rank 0 writes `buffer` as `block` of `dataset` (after a write
    error, nothing: it only drains, so peers never wait on it)."""
    if state.error is not None:
        return
    if buffer.device.type != "cpu":
        staged = _carve(state.staging(), 0, buffer.shape, buffer.dtype)
        buffer = staged.copy_(buffer)
    try:
        dataset[tuple(slice(a, b) for a, b in block)] = _to_numpy(buffer)
    except Exception as e:
        state.error = e


class _Writer:
    """Rank 0's side: receives and writes the pieces of one variable."""

    def __init__(self, dataset, local, owners, state):
        self.dataset = dataset
        self.local = local
        self.owners = owners
        self.state = state
        self.own = [ranges for rank, ranges in owners if rank == 0]

    def post(self, block, slot):
        """Starts the receives of `block` into `slot` and copies rank 0's
        own part."""
        shape = tuple(b - a for a, b in block)
        local = self.local
        if self.own and local.device.type == "cpu":
            overlap = _overlap(block, self.own[0])
            if overlap and all(
                s.stop - s.start == n
                for s, n in zip(overlap[0], shape, strict=True)
            ):  # all of it is here: write a view, no copy
                return block, local[overlap[1]], []
        buffer = _carve(slot, 0, shape, local.dtype)
        offset = self.state.slot_bytes
        pending = []
        for rank, ranges in self.owners:
            overlap = _overlap(block, ranges)
            if overlap is None:
                continue
            in_block, in_shard = overlap
            target = buffer[in_block]
            if rank == 0:
                target.copy_(local[in_shard])
                continue
            into = target
            if not target.is_contiguous():
                into = _carve(slot, offset, target.shape, local.dtype)
                offset += -(-into.nbytes // _ALIGN) * _ALIGN
            pending.append((dist.irecv(into, src=rank), target, into))
        return block, buffer, pending

    def finish(self, posted):
        """Waits for `posted`'s receives, then writes it."""
        block, buffer, pending = posted
        for work, target, into in pending:
            work.wait()
            if into is not target:
                target.copy_(into)
        _put(self.state, self.dataset, block, buffer)

    def run(self, blocks):
        slots = self.state.slots(self.local.device)
        posted = None
        for i, block in enumerate(blocks):
            following = self.post(block, slots[i % 2])
            if posted is not None:
                self.finish(posted)
            posted = following
        if posted is not None:
            self.finish(posted)


def _send(local, blocks, ranges):
    """Another rank's side: sends its shard's part of every block."""
    works = []
    for block in blocks:
        overlap = _overlap(block, ranges)
        if overlap is not None:
            works.append(dist.isend(local[overlap[1]].contiguous(), dst=0))
    for work in works:
        work.wait()


def streamable(dtensor):
    """Whether `write` takes it (a partial sum is left to Keras's writer,
    which gathers it)."""
    return all(type(p) in (Shard, Replicate) for p in dtensor.placements)


def _create(store, key, value):
    if not store._h5_entry_initialized:
        store._create_h5_group(store._h5_entry_path)
    dtype = numpy_dtype(value.dtype)
    dataset = store._h5_entry_group.create_dataset(
        key, shape=tuple(value.shape), dtype=dtype
    )
    if value.dtype == torch.bfloat16:
        dataset.attrs["dtype"] = "bfloat16"  # as Keras marks it
    return dataset


def write(store, key, value, state):
    """Writes DTensor `value` as `store[key]`, every rank taking part."""
    owners = shard_owners(value.shape, value.device_mesh, value.placements)
    local = value.to_local()
    itemsize = value.element_size()
    blocks = pieces(value.shape, itemsize, state.piece_bytes)
    rank = dist.get_rank()
    dataset = None
    if state.error is None:
        try:
            dataset = _create(store, key, value)
        except Exception as e:
            state.error = e
    if value.device_mesh.device_type == "cpu" and state.shared_ranks is None:
        state.shared, state.shared_ranks = shm_blocks.attach(state.slot_bytes)
    if shm_blocks.usable(state.shared_ranks or (), local, owners):
        shm_blocks.fill(
            state.shared,
            local,
            blocks,
            owners,
            _overlap,
            _carve,
            lambda block, values: _put(state, dataset, block, values),
        )
        return
    if rank == 0:
        _Writer(dataset, local, owners, state).run(blocks)
        return
    mine = [ranges for owner, ranges in owners if owner == rank]
    if mine:
        _send(local, blocks, mine[0])
