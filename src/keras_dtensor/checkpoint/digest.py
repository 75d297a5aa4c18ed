"""The checksums of a checkpoint file: a CRC-32 per block, on threads.

A file's digest (`crc32_blocks`) is the CRC-32 (zlib's) of each of its
blocks of `BLOCK` bytes (the last one shorter; none for an empty file),
as 8 hex digits each, in order. The blocks are checksummed independently,
so a file is checksummed on several threads at once (`zlib` lets go of
the GIL on large buffers) while a writer writes it or a load checks it.

A CRC-32 rather than a cryptographic hash, because what a checkpoint
meets is accidental damage, and a cryptographic hash of every byte would
cost more than the save itself (the benchmark history has the figures).
What a CRC-32 per block detects: any change of 1 or 2 bits or of a run
of up to 32 bits in a block, and other damage except with a chance of
2^-32 per damaged block; a truncated, extended or missing file by its
size. It is not tamper-evident (a forger can fix up a CRC, and the
manifest is not signed either).

The threads are a pool shared by the process: at most `_MAX_THREADS`,
and no more than this process's share of the cores it may run on (the
cores over the processes of the node, `LOCAL_WORLD_SIZE`), one at least.
The calling thread works too.

Example:
>>> digest = BlockDigest()
>>> run(digest.tasks(memoryview(b"abc")))
>>> digest.hexdigest() == hash_file("abc.bin")["crc32_blocks"]
True
"""

import collections
import concurrent.futures
import functools
import hashlib
import os
import threading
import zlib

__all__ = [
    "BLOCK",
    "BlockDigest",
    "first_difference",
    "hash_file",
    "hash_whole_file",
    "run",
]

BLOCK = 16 * 2**20  # bytes of one block: one CRC-32
_READ = 2**20  # bytes read at a time: the buffer stays in the cache
_MAX_THREADS = 4

_local = threading.local()


def _threads():
    """Worker threads for this process: its share of the usable cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        local = 1
    return max(1, min(_MAX_THREADS, cores // local))


@functools.cache
def _workers(pid):
    """`(pool, threads)` of process `pid` (after a fork, the child asks
    for its own: threads do not follow a fork)."""
    threads = _threads()
    pool = concurrent.futures.ThreadPoolExecutor(
        threads, thread_name_prefix="keras_dtensor_digest"
    )
    return pool, threads


def run(tasks, first=None):
    """Runs the callables `tasks` on the pool and this thread; returns
    `first()`, which this thread runs first, once every task is done.

    Nothing is left running when it returns or raises (a task may read
    memory the caller frees next).
    """
    queue = collections.deque(tasks)

    def drain():
        while True:
            try:
                task = queue.popleft()
            except IndexError:
                return
            task()

    helpers = []
    if len(queue) > 1 or (queue and first is not None):
        pool, threads = _workers(os.getpid())
        count = min(threads, len(queue))
        helpers = [pool.submit(drain) for _ in range(count)]
    try:
        result = first() if first is not None else None
        drain()
    except BaseException:
        queue.clear()
        concurrent.futures.wait(helpers)
        raise
    concurrent.futures.wait(helpers)
    for helper in helpers:
        helper.result()  # a task's error, once none runs
    return result


class _Crc32:
    """zlib's CRC-32 with a hash object's `update`."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = 0

    def update(self, data):
        self.value = zlib.crc32(data, self.value)


def _hex(checksums):
    return "".join(f"{c.value:08x}" for c in checksums)


class BlockDigest:
    """A file's `crc32_blocks`, fed its bytes in order."""

    def __init__(self, block=BLOCK):
        self.block = block
        self.size = 0
        self._blocks = [_Crc32()]  # the last one open
        self._fill = 0

    def tasks(self, view):
        """Callables checksumming `view`, the file's next bytes: one per
        block it touches, to run (in any order, at once) before the next
        call."""
        out, pos = [], 0
        while pos < len(view):
            if self._fill == self.block:
                self._blocks.append(_Crc32())
                self._fill = 0
            take = min(self.block - self._fill, len(view) - pos)
            update = self._blocks[-1].update
            out.append(functools.partial(update, view[pos : pos + take]))
            self._fill += take
            pos += take
        self.size += len(view)
        return out

    def hexdigest(self):
        return _hex(self._blocks if self.size else [])


def _buffer():
    """This thread's read buffer."""
    buffer = getattr(_local, "buffer", None)
    if buffer is None:
        buffer = _local.buffer = memoryview(bytearray(_READ))
    return buffer


def _hash_range(fd, digest, start, stop):
    buffer = _buffer()
    while start < stop:
        got = os.preadv(fd, [buffer[: min(_READ, stop - start)]], start)
        if not got:  # shorter than its size a moment ago: a mismatch
            digest.update(b"\0truncated")
            return
        digest.update(buffer[:got])
        start += got


def hash_file(path, block=BLOCK):
    """`{"crc32_blocks", "size"}` of the file at `path`, its blocks
    checksummed on the pool's threads."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        blocks = [_Crc32() for _ in range(-(-size // block))]
        run(
            functools.partial(
                _hash_range,
                f.fileno(),
                c,
                i * block,
                min(size, (i + 1) * block),
            )
            for i, c in enumerate(blocks)
        )
    return {"crc32_blocks": _hex(blocks), "size": size}


def first_difference(found, expected, block):
    """`(start, stop)` bytes of the first block whose checksums differ
    (`crc32_blocks` of the same size), or `None`."""
    for i in range(0, max(len(found), len(expected)), 8):
        if found[i : i + 8] != expected[i : i + 8]:
            return i // 8 * block, (i // 8 + 1) * block
    return None


def hash_whole_file(path):
    """`{"sha256", "size"}`: one SHA-256 of the whole file (the manifests of
    `keras-dtensor-checkpoint/1`)."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        _hash_range(f.fileno(), digest, 0, size)
    return {"sha256": digest.hexdigest(), "size": size}
