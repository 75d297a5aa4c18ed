"""The checksums of a checkpoint file: a CRC-32 per block.

A file's digest (`crc32_blocks`) is zlib's CRC-32 of each of its blocks
of `BLOCK` bytes (the last one shorter), 8 hex digits each, in order: it
finds accidental damage, cheaply; it is not tamper-evident.
"""

import hashlib
import os
import zlib

__all__ = [
    "BLOCK",
    "BlockDigest",
    "first_difference",
    "hash_file",
    "hash_whole_file",
]

BLOCK = 16 * 2**20  # bytes of one block: one CRC-32
_READ = 2**20  # bytes read at a time: the buffer stays in the cache


class BlockDigest:
    """A file's `crc32_blocks`, fed its bytes in order."""

    def __init__(self, block=BLOCK):
        self.block = block
        self.size = 0
        self._crcs = []
        self._fill = block  # the last block is full: the next byte opens one

    def update(self, data):
        view = memoryview(data).cast("B")
        pos = 0
        while pos < len(view):
            if self._fill == self.block:
                self._crcs.append(0)
                self._fill = 0
            take = min(self.block - self._fill, len(view) - pos)
            self._crcs[-1] = zlib.crc32(view[pos : pos + take], self._crcs[-1])
            self._fill += take
            pos += take
        self.size += len(view)

    def hexdigest(self):
        return "".join(f"{crc:08x}" for crc in self._crcs)


def _read(path, update):
    """Feeds the file's bytes (as long as when opened) to `update`."""
    buffer = memoryview(bytearray(_READ))
    with open(path, "rb", buffering=0) as f:
        size = left = os.fstat(f.fileno()).st_size
        while left and (got := f.readinto(buffer[:left])):
            update(buffer[:got])
            left -= got
    return size


def hash_file(path, block=BLOCK):
    """`{"crc32_blocks", "size"}` of the file at `path`."""
    digest = BlockDigest(block)
    size = _read(path, digest.update)
    return {"crc32_blocks": digest.hexdigest(), "size": size}


def first_difference(found, expected, block):
    """`(start, stop)` bytes of the first block whose CRCs differ, or
    `None`."""
    for i in range(0, max(len(found), len(expected)), 8):
        if found[i : i + 8] != expected[i : i + 8]:
            return i // 8 * block, (i // 8 + 1) * block
    return None


def hash_whole_file(path):
    """`{"sha256", "size"}` of the whole file (format 1's digest)."""
    digest = hashlib.sha256()
    size = _read(path, digest.update)
    return {"sha256": digest.hexdigest(), "size": size}
