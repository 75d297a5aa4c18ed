"""A `.zip` written in one pass, one member of it filled in place.

`StoredZip` gives the `.keras` weights member a `Window` on the archive
that h5py writes at any offset, instead of Keras's temporary `.h5` and
copy. Its CRC-32 is joined (`crc32.combine`) from its large writes'
checksums, taken as written, and the small bytes between, read back.
"""

import bisect
import io
import math
import os
import time
import zipfile
import zlib

from keras_dtensor.saving import crc32

__all__ = ["StoredZip"]

_CHUNK = 1 << 20  # bytes read at a time (a CRC-32, a copy)
_SUMMED = 1 << 20  # writes this large are checksummed as they are written


class StoredZip:
    """A zip archive written at explicit offsets into `fileobj`, an empty
    binary file with a path (`name`); leaving the context without an
    error writes the central directory."""

    def __init__(self, fileobj):
        fileobj.flush()
        if fileobj.tell() != 0:
            raise ValueError(
                "StoredZip writes from the start of an empty file. "
                f"Received: a file at offset {fileobj.tell()}"
            )
        self._file = fileobj
        self._fd = os.open(fileobj.name, os.O_RDWR)
        self._end = 0
        self._entries = []
        self._open = None

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        try:
            if kind is None:
                self._close()
        finally:
            os.close(self._fd)
        return False

    def _write_at(self, offset, data):
        view = memoryview(data).cast("B")
        while view:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def _start(self, info, crc=0, zip64=None):
        """Writes `info`'s local header (ZIP64 or not, for good)."""
        if self._open is not None:
            raise ValueError(
                f"Member {self._open.entry.filename!r} is still being "
                f"written. Received: a new member {info.filename!r}"
            )
        info.CRC, info.compress_size = crc, info.file_size
        info.header_offset = self._end
        header = info.FileHeader(zip64)
        self._write_at(self._end, header)
        self._end += len(header)
        self._entries.append(info)

    def writestr(self, name, data):
        """Adds a member holding the bytes `data`."""
        info = zipfile.ZipInfo(name, time.localtime()[:6])
        info.external_attr = 0o600 << 16
        info.file_size = len(data)
        self._start(info, zlib.crc32(data))
        self._write_at(self._end, data)
        self._end += len(data)

    def write(self, path, arcname):
        """Adds the file or directory `path` as `ZipFile.write` does."""
        info = zipfile.ZipInfo.from_file(path, arcname, strict_timestamps=False)
        self._start(info)
        if info.is_dir():
            return
        crc, copied = 0, 0
        with open(path, "rb") as source:
            while chunk := source.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
                self._write_at(self._end + copied, chunk)
                copied += len(chunk)
        if copied != info.file_size:
            raise OSError(f"{path!r} changed size while it was zipped")
        info.CRC = crc
        self._write_at(info.header_offset, info.FileHeader())
        self._end += copied

    def member(self, name):
        """A member written in place at any offset: a `Window`."""
        info = zipfile.ZipInfo(name, time.localtime()[:6])
        info.external_attr = 0o600 << 16
        self._start(info, zip64=True)
        self._open = Window(self, info, self._end)
        return self._open

    def _close(self):
        """Has `ZipFile` write the central directory after the members."""
        if self._open is not None:
            raise ValueError(
                f"Member {self._open.entry.filename!r} was not finished."
            )
        self._file.seek(self._end)
        with zipfile.ZipFile(self._file, "w") as directory:
            directory.filelist = self._entries
        os.ftruncate(self._fd, self._file.tell())


class Window(io.BytesIO):
    """A `StoredZip` member as a seekable file (an `io.BytesIO` to Keras's
    `H5IOStore`); leaving the context without an error finishes it."""

    def __init__(self, archive, entry, base):
        super().__init__()
        self.archive = archive
        self.entry = entry
        self.base = base
        self.size = 0
        self._position = 0
        # `(start, stop, crc)` of pieces as last written: sorted, disjoint.
        self._summed = []

    def __exit__(self, kind, value, traceback):
        if kind is None:  # the member's sizes and CRC-32 into its header
            info, archive = self.entry, self.archive
            info.file_size = info.compress_size = self.size
            info.CRC = self.crc()
            archive._write_at(info.header_offset, info.FileHeader(True))
            archive._end, archive._open = self.base + self.size, None
        return False

    def tell(self):
        return self._position

    def seek(self, offset, whence=os.SEEK_SET):
        start = {os.SEEK_SET: 0, os.SEEK_CUR: self._position}
        self._position = start.get(whence, self.size) + offset
        return self._position

    def write(self, data):
        view = memoryview(data).cast("B")
        start, stop = self._position, self._position + len(view)
        self._forget(start, stop)
        self.archive._write_at(self.base + start, view)
        if len(view) >= _SUMMED:  # checksummed while it is in the cache
            bisect.insort(self._summed, (start, stop, zlib.crc32(view)))
        self._position = stop
        self.size = max(self.size, stop)
        return len(view)

    def _forget(self, start, stop):
        """Drops the CRC-32 of the pieces that `[start, stop)` touches."""
        first = bisect.bisect_left(self._summed, (start,))
        if first and self._summed[first - 1][1] > start:
            first -= 1
        last = bisect.bisect_left(self._summed, (stop,), lo=first)
        del self._summed[first:last]

    def readinto(self, buffer):
        view = memoryview(buffer).cast("B")
        count = max(0, min(len(view), self.size - self._position))
        at = self.base + self._position
        got = os.preadv(self.archive._fd, [view[:count]], at)
        self._position += got
        return got

    def read(self, size=-1):
        if size is None or size < 0:
            size = max(0, self.size - self._position)
        buffer = bytearray(size)
        return bytes(buffer[: self.readinto(buffer)])

    def truncate(self, size=None):
        size = self._position if size is None else size
        os.ftruncate(self.archive._fd, self.base + size)
        self._forget(size, math.inf)
        self.size = size
        return size

    def crc(self):
        """The member's CRC-32: its pieces' joined, the gaps read back."""
        crc, buffer = 0, memoryview(bytearray(_CHUNK))
        self.seek(0)
        for start, stop, piece in [*self._summed, (self.size, self.size, 0)]:
            while self._position < start:
                got = self.readinto(buffer[: start - self._position])
                if got <= 0:
                    raise OSError("the archive is shorter than its member")
                crc = zlib.crc32(buffer[:got], crc)
            crc = crc32.combine(crc, piece, stop - start)
            self.seek(stop)
        return crc
