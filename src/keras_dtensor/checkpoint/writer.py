"""Writing sharded checkpoints: the digest of every file, taken on write.

A file not written in one pass is read again at commit. `torch.save`
skips its zip CRC-32 meanwhile: the manifest covers the same bytes.
"""

import contextlib
import os
import threading

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem

from keras_dtensor.checkpoint import manifest

__all__ = ["DigestingWriter"]


class _Crc32Off:
    """`torch.save` without its zip CRC-32 while any of our writes run
    (process-wide; an async save may overlap another)."""

    lock = threading.Lock()
    depth = 0
    saved = True

    def __enter__(self):
        with _Crc32Off.lock:
            if _Crc32Off.depth == 0:
                _Crc32Off.saved = torch.serialization.get_crc32_options()
                torch.serialization.set_crc32_options(False)
            _Crc32Off.depth += 1

    def __exit__(self, *exc):
        with _Crc32Off.lock:
            _Crc32Off.depth -= 1
            if _Crc32Off.depth == 0:
                torch.serialization.set_crc32_options(_Crc32Off.saved)


class _DigestStream:
    """A file opened for writing that checksums what goes through it."""

    def __init__(self, raw, digests, name):
        self._raw = raw
        self._digest = manifest.BlockDigest()
        self._one_pass = True
        self._digests, self._name = digests, name

    def write(self, data):
        written = self._raw.write(data)
        self._digest.update(memoryview(data).cast("B")[:written])
        return written

    def seek(self, *args):  # not one pass any more: hashed again later
        self._one_pass = False
        return self._raw.seek(*args)

    def __getattr__(self, name):  # a write past `write` changes the size
        return getattr(self._raw, name)

    def close(self):
        if self._raw.closed:
            return
        self._raw.flush()
        size = os.fstat(self._raw.fileno()).st_size
        self._raw.close()
        if self._one_pass and size == self._digest.size:
            found = {"crc32_blocks": self._digest.hexdigest(), "size": size}
            self._digests[self._name] = found


class _DigestingFileSystem(filesystem.FileSystem):
    """DCP's local file system, keeping a digest of every file written."""

    def __init__(self):
        super().__init__()
        self.digests = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        name = os.path.basename(os.fspath(path))
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            self.digests.pop(name, None)
            stream = _DigestStream(raw, self.digests, name)
            try:
                yield stream
            finally:
                stream.close()

    def rename(self, path, new_path):
        super().rename(path, new_path)
        found = self.digests.pop(os.path.basename(os.fspath(path)), None)
        if found is not None:
            self.digests[os.path.basename(os.fspath(new_path))] = found


class DigestingWriter(dcp.FileSystemWriter):
    """`FileSystemWriter` with `digests`, `{file name: digest}`, of the
    files this process wrote."""

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        self.fs = _DigestingFileSystem()
        self.digests = self.fs.digests

    def write_data(self, plan, planner):
        with _Crc32Off():
            return super().write_data(plan, planner)
