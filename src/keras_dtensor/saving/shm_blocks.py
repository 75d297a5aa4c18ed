"""Blocks assembled in shared memory by the ranks of rank 0's host.

Each rank copies its part of a block into rank 0's buffers in `/dev/shm`
while rank 0 writes out the one before; two pipes per rank say "buffer
free" and "part in" (not the process group: a round trip on rank 0's
time). If any of it fails, the parts go through the process group.
"""

import contextlib
import mmap
import os
import select
import stat
import struct
import uuid

import torch
import torch.distributed as dist

from keras_dtensor import config
from keras_dtensor.backend import launch

__all__ = [
    "SLOTS",
    "Shared",
    "attach",
    "free_slot",
    "grant",
    "hear",
    "part_in",
]

_DIRECTORY = "/dev/shm"
SLOTS = 2  # block buffers: one written out while the others fill one
_MESSAGE = struct.Struct("<q")  # a block's index


class Shared:
    """One save's mapped buffers and this rank's pipes, `{rank: (free,
    filled)}`."""

    def __init__(self, memory, slot_bytes, pipes):
        self._memory = memory
        self.pipes = pipes
        whole = torch.frombuffer(memory, dtype=torch.uint8)
        self.slots = [
            whole[i * slot_bytes : (i + 1) * slot_bytes] for i in range(SLOTS)
        ]

    def close(self):
        self.slots = []
        _close(self.pipes)
        self.pipes = {}
        with contextlib.suppress(BufferError):  # a view still alive
            self._memory.close()


def _close(pipes):
    for descriptors in pipes.values():
        for fd in descriptors:
            os.close(fd)


def _paths(base, rank):
    return f"{base}.{rank}.free", f"{base}.{rank}.filled"


def _open(base, size, rank, world):
    """Rank 0 makes the memory (its space reserved) and every rank's pipes;
    another rank opens the memory and its own pipes."""
    create = os.O_CREAT | os.O_EXCL if rank == 0 else 0
    fd = os.open(base, os.O_RDWR | os.O_CLOEXEC | create, 0o600)
    try:
        if rank == 0:
            os.posix_fallocate(fd, 0, size)
        elif os.fstat(fd).st_size != size:
            raise OSError("another size")
        memory = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    pipes = {}
    try:  # opened for reading and writing: no wait for the other end
        for peer in range(1, world) if rank == 0 else [rank]:
            opened = pipes[0 if rank else peer] = []
            for path in _paths(base, peer):
                if rank == 0:
                    os.mkfifo(path, 0o600)
                opened.append(os.open(path, os.O_RDWR | os.O_CLOEXEC))
                if not stat.S_ISFIFO(os.fstat(opened[-1]).st_mode):
                    raise OSError(f"{path} is not a pipe")
    except OSError:
        _close(pipes)
        memory.close()
        raise
    return memory, pipes


def _remove(base, world):
    for path in [base] + [p for r in range(1, world) for p in _paths(base, r)]:
        with contextlib.suppress(OSError):
            os.unlink(path)


def attach(slot_bytes):
    """`(Shared or None, ranks that opened rank 0's files)`; a collective.
    The names are unique (`uuid4`), so a rank that opens one has rank 0's."""
    size = SLOTS * slot_bytes
    world, rank = dist.get_world_size(), dist.get_rank()
    base = os.path.join(_DIRECTORY, f"keras_dtensor_save_{uuid.uuid4().hex}")
    memory = pipes = None
    if rank == 0:
        try:
            memory, pipes = _open(base, size, rank, world)
        except (OSError, AttributeError, ValueError):  # no /dev/shm, full
            memory = None
    sent = base.encode() if memory is not None else b""
    found = launch.broadcast_bytes(sent if rank == 0 else None)
    if found and rank != 0:
        base = found.decode()
        try:
            memory, pipes = _open(base, size, rank, world)
        except (OSError, ValueError):
            memory = None
    opened = launch.all_gather_ints(int(memory is not None))
    ranks = frozenset(r for r, ok in enumerate(opened) if ok and opened[0])
    if rank == 0:
        _remove(base, world)  # every rank that could open them has
        _close({peer: pipes.pop(peer) for peer in set(pipes or ()) - ranks})
    if memory is None:
        return None, ranks
    return Shared(memory, slot_bytes, pipes), ranks


def hear(shared, who, block):
    """Waits for rank `who`'s message for `block`: on rank 0, its part is
    in; on another rank (`who` 0), the block's buffer is free."""
    fd = shared.pipes[who][1 if who else 0]
    timeout = config.get("TIMEOUT")
    data = b""
    while len(data) < _MESSAGE.size:
        if not select.select([fd], [], [], timeout)[0]:
            raise TimeoutError(
                f"Rank {who} did not answer for block {block} of a save "
                f"within {timeout} s (KERAS_DTENSOR_TIMEOUT)."
            )
        data += os.read(fd, _MESSAGE.size - len(data))
    heard = _MESSAGE.unpack(data)[0]
    if heard != block:
        raise RuntimeError(f"Rank {who} is at block {heard}, not {block}.")


def grant(shared, block, parts):
    """Rank 0: tells the ranks of `parts` that `block`'s buffer is free."""
    for rank, _ in parts:
        os.write(shared.pipes[rank][0], _MESSAGE.pack(block))


def free_slot(shared, block):
    """Another rank: `block`'s buffer, once rank 0 says it is free."""
    hear(shared, 0, block)
    return shared.slots[block % SLOTS]


def part_in(shared, block):
    """Another rank: tells rank 0 its part of `block` is in."""
    os.write(shared.pipes[0][1], _MESSAGE.pack(block))
