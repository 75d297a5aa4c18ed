"""Writing sharded checkpoints: the digest of every file, taken on write.

`DigestingWriter` is DCP's public `FileSystemWriter` with a `FileSystem`
whose output streams checksum what they write: the digest of each file
(`crc32_blocks`, `digest.py`: a CRC-32 per 16 MiB block, taken on the
digest threads while this thread writes the same bytes) and its size
come from the bytes as they are written, not from reading the files
again. A file that was not written in one pass (a seek, or a size that
differs from the bytes counted) gets no digest and is read again.

While it writes, `torch.save` skips its per-record zip CRC-32
(`torch.serialization.set_crc32_options`): `torch.load` never checks it
(flipped bytes load silently), it costs as much as the manifest's
checksums (measured: BENCHMARKS.md), and those, checked before every
load, cover the same bytes. Tools that unzip a record and check its CRC
will complain; `torch.load` reads it.
"""

import contextlib
import os
import threading

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem

from keras_dtensor.checkpoint import digest

__all__ = ["DigestingWriter"]

_THREADED = 2**20  # writes this large are checksummed on the threads


class _Crc32Off:
    """`torch.save` without its zip CRC-32 while any of our writes run.

    The option is torch's and process-wide: the first writer in turns it
    off, the last one out restores what it was (writes may overlap when
    an async save is still running).
    """

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

    def __init__(self, raw, on_close):
        self._raw = raw
        self._digest = digest.BlockDigest()
        self._one_pass = True
        self._on_close = on_close

    def write(self, data):
        view = memoryview(data).cast("B")
        if len(view) < _THREADED:
            written = self._raw.write(data)
            for task in self._digest.tasks(view[:written]):
                task()
            return written
        # The digest threads checksum `view` while this thread writes it;
        # both are done before `data` goes back to its owner.
        tasks = self._digest.tasks(view)
        written = digest.run(tasks, lambda: self._raw.write(data))
        if written != len(view):  # counted bytes that were not written
            self._one_pass = False
        return written

    def seek(self, *args):  # not one pass any more: hashed again later
        self._one_pass = False
        return self._raw.seek(*args)

    def tell(self):
        return self._raw.tell()

    def flush(self):
        self._raw.flush()

    def fileno(self):
        return self._raw.fileno()

    def close(self):
        if self._raw.closed:
            return
        self._raw.flush()
        size = os.fstat(self._raw.fileno()).st_size
        self._raw.close()
        if self._one_pass and size == self._digest.size:
            self._on_close(
                {"crc32_blocks": self._digest.hexdigest(), "size": size}
            )


class _DigestingFileSystem(filesystem.FileSystem):
    """DCP's local file system, keeping a digest of every file written."""

    def __init__(self):
        super().__init__()
        self.digests = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = os.path.basename(os.fspath(path))
        self.digests.pop(name, None)

        def record(found):
            self.digests[name] = found

        with super().create_stream(path, mode) as raw:
            stream = _DigestStream(raw, record)
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
    """`FileSystemWriter` whose `digests` are `{file name: {crc32_blocks,
    size}}` of the files this process wrote, taken while writing."""

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        self.fs = _DigestingFileSystem()

    @property
    def digests(self):
        return dict(self.fs.digests)

    def reset(self, checkpoint_id=None):
        super().reset(checkpoint_id)
        self.fs.digests.clear()

    def write_data(self, plan, planner):
        with _Crc32Off():
            return super().write_data(plan, planner)
