"""The checksums of a checkpoint file: a CRC-32 per block.

A file's digest (`crc32_blocks`) is the CRC-32 (zlib's) of each of its
blocks of `BLOCK` bytes (the last one shorter; none for an empty file),
as 8 hex digits each, in order. A CRC-32, not a cryptographic hash: what
a checkpoint meets is accidental damage, and a cryptographic hash of
every byte would cost more than the save itself. It is not
tamper-evident (nor is the unsigned manifest).

Example:
>>> digest = BlockDigest()
>>> digest.update(b"abc")
>>> digest.hexdigest() == hash_file("abc.bin")["crc32_blocks"]
True
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
    """Feeds the file's first `size` bytes (its size when opened) to
    `update`; returns `size`."""
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
    size = _read(path, digest.update)
    return {"sha256": digest.hexdigest(), "size": size}
