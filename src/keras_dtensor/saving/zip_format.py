"""The records of a zip file (APPNOTE.TXT), as `StoredZip` writes them:
members stored, names in UTF-8, ZIP64 fields where needed."""

import struct
import time

__all__ = ["Entry", "end_records"]

_LIMIT = 0xFFFFFFFF  # a size or offset from here on needs ZIP64 fields
_COUNT_LIMIT = 0xFFFF  # as many members or more: a ZIP64 end record
_LOCAL = struct.Struct("<4s5H3L2H")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_END = struct.Struct("<4s4H2LH")
_END64 = struct.Struct("<4sQ2H2L4Q")
_LOCATOR64 = struct.Struct("<4sLQL")
_UNIX = 3 << 8  # "version made by": the host system


def _field(value, limit, ones=0xFFFFFFFF):
    """A field of a header: the value, or all ones (see the ZIP64 one)."""
    return value if value < limit else ones


def _dos_time(seconds):
    t = time.localtime(seconds)
    year = max(t.tm_year, 1980)  # no earlier year in the format
    date = (year - 1980) << 9 | t.tm_mon << 5 | t.tm_mday
    return t.tm_hour << 11 | t.tm_min << 5 | t.tm_sec // 2, date


class Entry:
    """What the central directory says of one member."""

    def __init__(self, name, offset, attributes, seconds, size, zip64):
        self.name = name.encode("utf-8")
        self.flags = 0 if name.isascii() else 0x800  # UTF-8 name
        self.offset = offset
        self.attributes = attributes
        self.time, self.date = _dos_time(seconds)
        self.crc = 0
        self.size = size
        # Sizes in a ZIP64 extra field; its length is fixed once written.
        self.zip64 = zip64 or size >= _LIMIT

    def _fields(self, size, extra):
        """Both headers' fields from the flags to the extra field's length
        (compression 0: stored)."""
        stamp = (self.time, self.date, self.crc)
        return (self.flags, 0, *stamp, size, size, len(self.name), len(extra))

    def local_header(self):
        """The local header (written again when the member is finished)."""
        extra, size = b"", self.size
        if self.zip64:
            extra = struct.pack("<2H2Q", 1, 16, self.size, self.size)
            size = 0xFFFFFFFF
        version = 45 if self.zip64 else 20
        fields = self._fields(size, extra)
        return _LOCAL.pack(b"PK\x03\x04", version, *fields) + self.name + extra

    def central_header(self):
        big = [v for v in (self.size, self.size, self.offset) if v >= _LIMIT]
        extra = b""
        if big:
            extra = struct.pack(f"<2H{len(big)}Q", 1, 8 * len(big), *big)
        version = 45 if big else 20
        fields = self._fields(_field(self.size, _LIMIT), extra)
        # No comment, disk 0, no internal attributes.
        tail = (0, 0, 0, self.attributes, _field(self.offset, _LIMIT))
        head = (b"PK\x01\x02", _UNIX | version, version)
        return _CENTRAL.pack(*head, *fields, *tail) + self.name + extra


def end_records(count, start, size):
    """The records after a central directory of `count` members, at
    offset `start`, `size` bytes long."""
    tail = b""
    if count >= _COUNT_LIMIT or start >= _LIMIT or size >= _LIMIT:
        # The record's size after its size field, versions, disks 0.
        head = (b"PK\x06\x06", 44, _UNIX | 45, 45, 0, 0)
        tail = _END64.pack(*head, count, count, size, start)
        tail += _LOCATOR64.pack(b"PK\x06\x07", 0, start + size, 1)
    counts = (_field(count, _COUNT_LIMIT, 0xFFFF),) * 2
    fields = (*counts, _field(size, _LIMIT), _field(start, _LIMIT), 0)
    return tail + _END.pack(b"PK\x05\x06", 0, 0, *fields)
